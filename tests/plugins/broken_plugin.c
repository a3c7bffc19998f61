/* SPDX-License-Identifier: Apache-2.0 */
/* Deliberately broken plugins for the loader tests, one per BROKEN_* define.
 * Written in C99 against plugin.h alone, which also proves the header is C. */
#include <signal.h>
#include <stddef.h>
#include <stdio.h>

#include "ferry/plugin.h"

static int p_init(const ferry_host_v1* host, const char* key, const char* node,
                  const char* settings, void** ctx, char* err, size_t errlen) {
  (void)host;
  (void)key;
  (void)node;
  (void)settings;
#if defined(BROKEN_INIT_FAILS)
  snprintf(err, errlen, "no widget present on this host");
  *ctx = NULL;
  return FERRY_ERR_NO_DEVICE;
#elif defined(BROKEN_ERR_NO_NUL)
  /* Fills the whole buffer, no terminator: the core must not read past it. */
  for (size_t i = 0; i < errlen; ++i) err[i] = 'A';
  *ctx = NULL;
  return FERRY_ERR_NO_DEVICE;
#elif defined(BROKEN_INIT_CRASHES)
  /* As a segfaulting init ends: `ferry info` probes in a child and goes on. */
  (void)err;
  (void)errlen;
  (void)ctx;
  raise(SIGSEGV);
  return FERRY_ERR_BAD_STATE;
#elif defined(BROKEN_INIT_THROWS)
  /* Built as C++ (throwing_plugin.cpp): an exception out of init, across the
   * C ABI, which nothing may do - the core reports it and goes on. */
  (void)err;
  (void)errlen;
  (void)ctx;
  throw 42;
#else
  (void)err;
  (void)errlen;
  static int instance;
  *ctx = &instance;
  return FERRY_OK;
#endif
}
static void p_fini(void* ctx) { (void)ctx; }
static int p_conn_info(void* ctx, void* buf, size_t* len) {
  (void)ctx;
  (void)buf;
  *len = 0;
  return FERRY_OK;
}
static int p_peer_add(void* ctx, const ferry_peer_v1* peer, void** h) {
  (void)ctx;
  (void)peer;
  *h = NULL;
  return FERRY_OK;
}
static void p_peer_remove(void* ctx, void* h) {
  (void)ctx;
  (void)h;
}
static int p_mem_register(void* ctx, const ferry_mem_v1* m, void** h, void* blob, size_t* len) {
  (void)ctx;
  (void)m;
  (void)h;
  (void)blob;
  (void)len;
  return FERRY_ERR_UNSUPPORTED;
}
static void p_mem_deregister(void* ctx, void* h) {
  (void)ctx;
  (void)h;
}
static int p_mem_import(void* ctx, void* peer, uint64_t id, uint64_t size, const void* blob,
                        size_t len, void** h) {
  (void)ctx;
  (void)peer;
  (void)id;
  (void)size;
  (void)blob;
  (void)len;
  (void)h;
  return FERRY_ERR_UNSUPPORTED;
}
static void p_mem_release(void* ctx, void* h) {
  (void)ctx;
  (void)h;
}
static int p_post(void* ctx, const ferry_xfer_v1* x) {
  (void)ctx;
  (void)x;
  return FERRY_ERR_UNSUPPORTED;
}
static void p_on_ctrl(void* ctx, const char* peer, const void* msg, size_t len) {
  (void)ctx;
  (void)peer;
  (void)msg;
  (void)len;
}

/* Designated initialisers: the fields a newer header appends stay NULL, and the
 * same body builds against the frozen 1.1 header (abi-1.1/). */
#define OPS_BODY(NAME, SIZE, POST)                                                                 \
  {                                                                                                \
    .struct_size = SIZE, .abi_minor = FERRY_PLUGIN_ABI_MINOR, .name = NAME, .version = "0.0-test", \
    .caps = FERRY_CAP_MEM_CPU | FERRY_CAP_OP_WRITE, .init = p_init, .fini = p_fini,                \
    .conn_info = p_conn_info, .peer_add = p_peer_add, .peer_remove = p_peer_remove,                \
    .mem_register = p_mem_register, .mem_deregister = p_mem_deregister,                            \
    .mem_import = p_mem_import, .mem_release = p_mem_release, .post = POST, .on_ctrl = p_on_ctrl,  \
    .describe = NULL                                                                               \
  }

#if defined(BROKEN_NEWER_ABI)
/* Built for a future ABI major only. */
FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v2 =
    OPS_BODY("newabi", sizeof(ferry_plugin_ops_v1), p_post);
#elif defined(BROKEN_NO_SYMBOL)
FERRY_PLUGIN_EXPORT int not_a_ferry_plugin = 1;
#elif defined(BROKEN_SMALL_OPS)
FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 = OPS_BODY("smallops", 16, p_post);
#elif defined(BROKEN_MISNAMED)
FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 =
    OPS_BODY("someoneelse", sizeof(ferry_plugin_ops_v1), p_post);
#elif defined(BROKEN_NO_POST)
FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 =
    OPS_BODY("nopost", sizeof(ferry_plugin_ops_v1), NULL);
#elif defined(BROKEN_ABI_1_1)
/* Not broken: built against the frozen ABI 1.1 header (tests/plugins/abi-1.1),
 * whose ops table ends before fence(). It must load and work with this core. */
FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 =
    OPS_BODY("abi11", sizeof(ferry_plugin_ops_v1), p_post);
#elif defined(BROKEN_INIT_FAILS)
FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 =
    OPS_BODY("initfail", sizeof(ferry_plugin_ops_v1), p_post);
#elif defined(BROKEN_ERR_NO_NUL)
FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 =
    OPS_BODY("errnonul", sizeof(ferry_plugin_ops_v1), p_post);
#elif defined(BROKEN_INIT_CRASHES)
FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 =
    OPS_BODY("initcrash", sizeof(ferry_plugin_ops_v1), p_post);
#elif defined(BROKEN_SIZE_MINOR)
/* Loads (nothing past its 1.0 table is read), but says a minor whose table is
 * longer: the loader warns, ferry-plugin-check fails it. */
FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 =
    OPS_BODY("sizeminor", offsetof(ferry_plugin_ops_v1, describe) + sizeof(void*), p_post);
#elif defined(BROKEN_INIT_THROWS)
extern "C" FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 =
    OPS_BODY("initthrows", sizeof(ferry_plugin_ops_v1), p_post);
#else
#error "define one BROKEN_* variant"
#endif
