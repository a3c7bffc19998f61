/* SPDX-License-Identifier: Apache-2.0 */
/* libferry-null.so: a bench-only backend that moves nothing and completes every
 * transfer inside post(). With it, a transfer's cost is the core's own: the
 * submit path (validation, route lookup, attempt bookkeeping) plus completion.
 * It takes several region pairs per post (MULTI_PAIR), as xgmi does, so a
 * multi-region call is measured as the one transfer it is there.
 * Never installed; the micro benches load it from their own folder. */
#include <stdlib.h>
#include <string.h>

#include "ferry/plugin.h"

typedef struct {
  const ferry_host_v1* host;
} null_ctx;

static int null_init(const ferry_host_v1* host, const char* engine_key, const char* node_id,
                     const char* settings_json, void** ctx, char* err, size_t errlen) {
  null_ctx* c = (null_ctx*)calloc(1, sizeof *c);
  (void)engine_key;
  (void)node_id;
  (void)settings_json;
  (void)err;
  (void)errlen;
  if (!c) return FERRY_ERR_NO_MEMORY;
  c->host = host;
  *ctx = c;
  return FERRY_OK;
}

static void null_fini(void* ctx) { free(ctx); }

static int null_conn_info(void* ctx, void* buf, size_t* len) {
  (void)ctx;
  if (*len < 1) return FERRY_ERR_INVALID_ARGS;
  ((unsigned char*)buf)[0] = 1; /* any non-empty blob: "reachable" */
  *len = 1;
  return FERRY_OK;
}

/* Handles only need to be distinct non-NULL pointers. */
static char peer_tag, mem_tag, remote_tag;

static int null_peer_add(void* ctx, const ferry_peer_v1* peer, void** h) {
  (void)ctx;
  (void)peer;
  *h = &peer_tag;
  return FERRY_OK;
}

static void null_peer_remove(void* ctx, void* h) {
  (void)ctx;
  (void)h;
}

static int null_mem_register(void* ctx, const ferry_mem_v1* mem, void** h, void* blob,
                             size_t* blob_len) {
  (void)ctx;
  (void)mem;
  if (*blob_len < 1) return FERRY_ERR_INVALID_ARGS;
  ((unsigned char*)blob)[0] = 1;
  *blob_len = 1;
  *h = &mem_tag;
  return FERRY_OK;
}

static void null_mem_deregister(void* ctx, void* h) {
  (void)ctx;
  (void)h;
}

static int null_mem_import(void* ctx, void* peer, uint64_t id, uint64_t size, const void* blob,
                           size_t blob_len, void** h) {
  (void)ctx;
  (void)peer;
  (void)id;
  (void)size;
  (void)blob;
  (void)blob_len;
  *h = &remote_tag;
  return FERRY_OK;
}

static void null_mem_release(void* ctx, void* h) {
  (void)ctx;
  (void)h;
}

static int null_post(void* ctx, const ferry_xfer_v1* x) {
  null_ctx* c = (null_ctx*)ctx;
  c->host->complete(c->host->host_ctx, x->xfer_ctx, FERRY_OK, NULL);
  return FERRY_OK;
}

static void null_on_ctrl(void* ctx, const char* peer, const void* msg, size_t len) {
  (void)ctx;
  (void)peer;
  (void)msg;
  (void)len;
}

FERRY_PLUGIN_EXPORT const ferry_plugin_ops_v1 ferry_plugin_v1 = {
    .struct_size = sizeof(ferry_plugin_ops_v1),
    .abi_minor = FERRY_PLUGIN_ABI_MINOR,
    .name = "null",
    .version = "0.1",
    .caps = FERRY_CAP_MEM_CPU | FERRY_CAP_OP_READ | FERRY_CAP_OP_WRITE | FERRY_CAP_NATIVE_NOTIFY |
            FERRY_CAP_INITIATOR_COPY | FERRY_CAP_MULTI_PAIR,
    .init = null_init,
    .fini = null_fini,
    .conn_info = null_conn_info,
    .peer_add = null_peer_add,
    .peer_remove = null_peer_remove,
    .mem_register = null_mem_register,
    .mem_deregister = null_mem_deregister,
    .mem_import = null_mem_import,
    .mem_release = null_mem_release,
    .post = null_post,
    .on_ctrl = null_on_ctrl,
};
