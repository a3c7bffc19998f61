/* SPDX-License-Identifier: Apache-2.0 */
/*
 * cma_blob.h - the two opaque blobs of the cma plugin, encoded and decoded.
 *
 * The core carries these bytes inside EngineDesc / MemoryDesc without looking at
 * them, so they may arrive from a peer built from another version of this
 * plugin, or be forged. Every blob starts with a version byte; integers are
 * little-endian and fixed-width, so the layout does not depend on the compiler.
 *
 *   connection blob:  u8 version | u32 pid | u64 start time | u64 pid namespace
 *                     | u16 node_id_len | node_id bytes
 *   memory blob:      u8 version | u64 region id | u64 address | u64 size
 *
 * The start time (field 22 of /proc/<pid>/stat) and the PID namespace (inode
 * of /proc/self/ns/pid) pin down *which* process the pid means: a pid is only
 * a number, reused after its process exits, and means another process in
 * another container. 0 = unknown (no /proc), not checked.
 */
#ifndef CMA_BLOB_H
#define CMA_BLOB_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define CMA_BLOB_VERSION 1u
#define CMA_CONN_HEADER 23u /* version + pid + start time + pid ns + node id length */
#define CMA_MAX_NODE_ID 1024u
#define CMA_MEM_BLOB_LEN 25u

static inline void cma_put_u16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
static inline void cma_put_u32(uint8_t *p, uint32_t v) {
  int i;
  for (i = 0; i < 4; ++i) p[i] = (uint8_t)(v >> (8 * i));
}
static inline void cma_put_u64(uint8_t *p, uint64_t v) {
  int i;
  for (i = 0; i < 8; ++i) p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t cma_get_u16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline uint32_t cma_get_u32(const uint8_t *p) {
  uint32_t v = 0;
  int i;
  for (i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
static inline uint64_t cma_get_u64(const uint8_t *p) {
  uint64_t v = 0;
  int i;
  for (i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

/* Bytes needed for a connection blob carrying a node id of node_len bytes. */
static inline size_t cma_conn_blob_len(size_t node_len) { return CMA_CONN_HEADER + node_len; }

/* Write the connection blob into buf (room: cap bytes). Returns the length, or 0
 * when it does not fit. */
typedef struct cma_conn {
  uint32_t pid;
  uint64_t start_time; /* clock ticks after boot, 0 = unknown */
  uint64_t pid_ns;     /* inode of /proc/self/ns/pid, 0 = unknown */
  const char *node_id; /* not NUL-terminated */
  size_t node_len;
} cma_conn;

static inline size_t cma_conn_encode(void *buf, size_t cap, const cma_conn *c) {
  uint8_t *p = (uint8_t *)buf;
  size_t node_len = c->node_len, need = cma_conn_blob_len(node_len);
  if (node_len > CMA_MAX_NODE_ID || cap < need) return 0;
  p[0] = (uint8_t)CMA_BLOB_VERSION;
  cma_put_u32(p + 1, c->pid);
  cma_put_u64(p + 5, c->start_time);
  cma_put_u64(p + 13, c->pid_ns);
  cma_put_u16(p + 21, (uint16_t)node_len);
  if (node_len > 0) memcpy(p + CMA_CONN_HEADER, c->node_id, node_len);
  return need;
}

/* Parse a connection blob. On success returns 1 and fills *c (node_id points
 * into the blob); returns 0 when malformed. */
static inline int cma_conn_decode(const void *blob, size_t len, cma_conn *c) {
  const uint8_t *p = (const uint8_t *)blob;
  size_t n;
  if (blob == NULL || len < CMA_CONN_HEADER || p[0] != CMA_BLOB_VERSION) return 0;
  n = cma_get_u16(p + 21);
  if (n > CMA_MAX_NODE_ID || len != CMA_CONN_HEADER + n) return 0;
  c->pid = cma_get_u32(p + 1);
  if (c->pid == 0 || c->pid > (uint32_t)INT32_MAX) return 0; /* pid_t is a positive int */
  c->start_time = cma_get_u64(p + 5);
  c->pid_ns = cma_get_u64(p + 13);
  c->node_id = (const char *)(p + CMA_CONN_HEADER);
  c->node_len = n;
  return 1;
}

static inline void cma_mem_encode(void *buf, uint64_t id, uint64_t addr, uint64_t size) {
  uint8_t *p = (uint8_t *)buf;
  p[0] = (uint8_t)CMA_BLOB_VERSION;
  cma_put_u64(p + 1, id);
  cma_put_u64(p + 9, addr);
  cma_put_u64(p + 17, size);
}

/* Returns 1 and fills the fields when the memory blob is well formed, else 0. */
static inline int cma_mem_decode(const void *blob, size_t len, uint64_t *id, uint64_t *addr,
                                 uint64_t *size) {
  const uint8_t *p = (const uint8_t *)blob;
  if (blob == NULL || len != CMA_MEM_BLOB_LEN || p[0] != CMA_BLOB_VERSION) return 0;
  *id = cma_get_u64(p + 1);
  *addr = cma_get_u64(p + 9);
  *size = cma_get_u64(p + 17);
  return 1;
}

#endif /* CMA_BLOB_H */
