/* Connections to the other hosts (see fabric.h). */
#include "daemon/cluster/fabric.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "daemon/cluster/address_check.h"

typedef struct fabric_host {
  fsdp_ucx_peer_t *peer; /* the current connection, NULL while none */
  char why[FSDP_STATUS_MESSAGE_MAX]; /* why there is none */
  uint8_t *address;      /* its worker's, as it joined; NULL while it is not joined */
  size_t address_len;
  char label[FSDP_UCX_LABEL_MAX];
} fabric_host_t;

/* A buffer registered with the worker, by its start. mem is NULL when UCX refused it. */
typedef struct fabric_memory {
  const void *addr;
  size_t len;
  fsdp_ucx_mem_t *mem;
  struct fabric_memory *next;
} fabric_memory_t;

struct fsdp_fabric {
  fsdp_peers_t *peers;
  fsdp_ucx_t *ucx;
  unsigned self;
  unsigned n_hosts;
  fabric_host_t *hosts;
  fabric_memory_t *memory;
  bool closing;
  void (*done)(void *data);
  void *done_data;
};

/* A new connection to a joined host from its address (old handles stay valid until the
 * worker closes). */
static void connect_host(fsdp_fabric_t *f, fabric_host_t *h) {
  h->peer = NULL;
  fsdp_status_t st;
  if (fsdp_ucx_connect(f->ucx, h->address, h->address_len, h->label, &h->peer, &st) < 0) {
    snprintf(h->why, sizeof h->why, "%s", st.message);
    log_error("data plane: %s", st.message);
    return;
  }
  log_info("data plane: connected to %s", h->label);
}

static void forget_address(fabric_host_t *h) {
  free(h->address);
  h->address = NULL;
  h->address_len = 0;
}

static void on_joined(void *data, unsigned host_rank, uint64_t incarnation,
                      const uint8_t *ucx_address, size_t ucx_address_len) {
  (void)incarnation;
  fsdp_fabric_t *f = data;
  if (host_rank >= f->n_hosts || host_rank == f->self)
    return;
  fabric_host_t *h = &f->hosts[host_rank];
  /* A rejoin may be a restarted daemon with a new worker: the old connection is failed and
   * a new one made. */
  if (h->peer)
    fsdp_ucx_peer_fail(h->peer, "the host joined again");
  h->peer = NULL;
  forget_address(h);
  if (!(h->address = malloc(ucx_address_len ? ucx_address_len : 1))) {
    snprintf(h->why, sizeof h->why, "out of memory for the address of %s", h->label);
    return;
  }
  memcpy(h->address, ucx_address, ucx_address_len);
  h->address_len = ucx_address_len;
  connect_host(f, h);
}

static void on_lost(void *data, unsigned host_rank, const char *why) {
  fsdp_fabric_t *f = data;
  if (host_rank >= f->n_hosts || host_rank == f->self)
    return;
  fabric_host_t *h = &f->hosts[host_rank];
  snprintf(h->why, sizeof h->why, "%s", why);
  if (h->peer)
    fsdp_ucx_peer_fail(h->peer, why);
  h->peer = NULL;
  forget_address(h);
}

int fsdp_fabric_new(uv_loop_t *loop, fsdp_peers_t *peers, fsdp_fabric_t **ret_fabric,
                    fsdp_status_t *st) {
  unsigned n = fsdp_peers_host_count(peers);
  if (n == 1) {
    *ret_fabric = NULL;
    return 0;
  }
  fsdp_fabric_t *f = calloc(1, sizeof *f);
  fabric_host_t *hosts = calloc(n, sizeof *hosts);
  if (!f || !hosts) {
    free(f);
    free(hosts);
    return fsdp_status_set(st, -ENOMEM, "out of memory for the data plane's %u hosts", n);
  }
  *f = (fsdp_fabric_t){.peers = peers, .self = fsdp_peers_host_rank(peers), .n_hosts = n,
                       .hosts = hosts};
  for (unsigned i = 0; i < n; i++) {
    fsdp_peer_info_t info;
    fsdp_peers_get(peers, i, &info);
    snprintf(hosts[i].label, sizeof hosts[i].label, "host %u (%s)", i, info.address);
    snprintf(hosts[i].why, sizeof hosts[i].why, "%s has not joined", hosts[i].label);
  }
  fsdp_ucx_options_t options = {.err_mode = FSDP_DATA_PLANE_UCX_ERR_MODE};
  int r = fsdp_ucx_new(loop, &options, &f->ucx, st);
  if (r < 0) {
    free(hosts);
    free(f);
    return r;
  }
  const void *address;
  size_t len;
  fsdp_ucx_address(f->ucx, &address, &len);
  if ((r = fsdp_peers_set_local_address(peers, address, len)) < 0) {
    fsdp_ucx_close(f->ucx, NULL, NULL);
    free(hosts);
    free(f);
    return fsdp_status_set(st, r, "cannot publish the data plane's address: %s",
                           fsdp_strerror(r));
  }
  fsdp_peers_set_callbacks(peers, &(fsdp_peers_callbacks_t){.joined = on_joined,
                                                            .lost = on_lost, .data = f});
  *ret_fabric = f;
  return 0;
}

fsdp_ucx_t *fsdp_fabric_ucx(const fsdp_fabric_t *fabric) {
  return fabric->ucx;
}

fsdp_ucx_peer_t *fsdp_fabric_peer(fsdp_fabric_t *fabric, unsigned host_rank,
                                  const char **ret_why) {
  if (host_rank >= fabric->n_hosts || host_rank == fabric->self) {
    if (ret_why)
      *ret_why = host_rank == fabric->self ? "it is this host" : "no such host";
    return NULL;
  }
  fabric_host_t *h = &fabric->hosts[host_rank];
  if (h->peer && fsdp_ucx_peer_error(h->peer) && h->address) {
    snprintf(h->why, sizeof h->why, "%s: %s", h->label, fsdp_ucx_peer_error(h->peer));
    connect_host(fabric, h);
  }
  if (ret_why)
    *ret_why = h->why;
  return h->peer;
}

const fsdp_ucx_mem_t *fsdp_fabric_memory(fsdp_fabric_t *fabric, void *addr, size_t len) {
  if (fabric->closing)
    return NULL;
  for (fabric_memory_t *m = fabric->memory; m; m = m->next)
    if (m->addr == addr && m->len == len)
      return m->mem;
  fabric_memory_t *m = calloc(1, sizeof *m);
  if (!m)
    return NULL;
  fsdp_status_t st;
  if (fsdp_ucx_mem_register(fabric->ucx, addr, len, &m->mem, &st) < 0)
    log_warning("data plane: transfers from and to this buffer go without a registration: %s",
                st.message);
  m->addr = addr;
  m->len = len;
  m->next = fabric->memory;
  fabric->memory = m;
  return m->mem;
}

void fsdp_fabric_forget_memory(fsdp_fabric_t *fabric, const void *addr, size_t len) {
  if (!fabric || fabric->closing)
    return;
  const char *lo = addr;
  for (fabric_memory_t **p = &fabric->memory; *p;) {
    fabric_memory_t *m = *p;
    const char *at = m->addr;
    if (at < lo || (size_t)(at - lo) >= len) {
      p = &m->next;
      continue;
    }
    *p = m->next;
    fsdp_ucx_mem_deregister(m->mem);
    free(m);
  }
}

static void on_ucx_closed(void *data) {
  fsdp_fabric_t *f = data;
  if (f->done)
    f->done(f->done_data);
  while (f->memory) { /* their registrations went with the UCX context */
    fabric_memory_t *m = f->memory;
    f->memory = m->next;
    free(m);
  }
  for (unsigned i = 0; i < f->n_hosts; i++)
    forget_address(&f->hosts[i]);
  free(f->hosts);
  free(f);
}

void fsdp_fabric_close(fsdp_fabric_t *fabric, void (*done)(void *data), void *data) {
  fsdp_peers_set_callbacks(fabric->peers, &(fsdp_peers_callbacks_t){0});
  fabric->closing = true;
  fabric->done = done;
  fabric->done_data = data;
  fsdp_ucx_close(fabric->ucx, on_ucx_closed, fabric);
}
