/* Accept loop, credentials and the connection limit of a listening socket. */
#include "daemon/accept/acceptor.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/fdpass.h"
#include "common/log.h"

/* Out of descriptors: accepting again at once would spin on the pending connection. */
#define ACCEPT_RETRY_MS 100

void fsdp_acceptor_release(fsdp_accepted_t *conn) {
  fsdp_list_remove(&conn->link);
  free(conn);
}

/* Drops the connections gRPC has closed from the list and returns how many of those of
 * `uid` (all of them on TCP) are left; the idle one to close first goes to ret_idle. fd is
 * the new connection's descriptor: an entry with that number was closed before it. Only
 * uid's entries are checked with fstat(2) (closed, or now another file), so a new
 * connection costs one uid's limit; the others go when their number is reused or their uid
 * connects. */
static unsigned count_conns(fsdp_acceptor_t *acceptor, int fd, uid_t uid,
                            fsdp_accepted_t **ret_idle) {
  unsigned n = 0;
  int idle_rank = 0;
  *ret_idle = NULL;
  fsdp_accepted_t *c, *next;
  fsdp_list_for_each_safe(c, next, &acceptor->conns, link) {
    bool other = c->closing || (acceptor->unix_socket && c->cred.uid != uid);
    struct stat sb;
    if (!c->owner &&
        (c->fd == fd || (!other && (fstat(c->fd, &sb) < 0 || sb.st_ino != c->ino)))) {
      fsdp_acceptor_release(c);
      continue;
    }
    if (other)
      continue;
    n++;
    int rank = acceptor->ops.idleness(acceptor->ops.data, c);
    if (rank != FSDP_ACCEPTED_BUSY &&
        (!*ret_idle || rank < idle_rank ||
         (rank == idle_rank && c->since_ms < (*ret_idle)->since_ms))) {
      *ret_idle = c;
      idle_rank = rank;
    }
  }
  return n;
}

/* Makes room for a connection of cred's uid under its limit and records it; NULL if it
 * must be refused. */
static fsdp_accepted_t *admit(fsdp_acceptor_t *acceptor, int fd, const fsdp_credentials_t *cred) {
  fsdp_accepted_t *idle;
  unsigned n = count_conns(acceptor, fd, cred->uid, &idle);
  if (n >= acceptor->limit) {
    if (!idle)
      return NULL;
    idle->closing = true;
    acceptor->ops.evict(acceptor->ops.data, idle, n, acceptor->limit);
  }
  struct stat sb;
  fsdp_accepted_t *c = calloc(1, sizeof *c);
  if (!c || fstat(fd, &sb) < 0) {
    free(c);
    return NULL;
  }
  *c = (fsdp_accepted_t){.acceptor = acceptor, .fd = fd, .ino = sb.st_ino, .cred = *cred,
                         .since_ms = uv_now(acceptor->loop)};
  fsdp_list_push_front(&acceptor->conns, &c->link);
  return c;
}

/* Logs why a connection is refused at the limit, tells it if the owner can, and closes it. */
static void refuse_at_limit(fsdp_acceptor_t *acceptor, int fd, const fsdp_credentials_t *cred) {
  char why[512];
  if (acceptor->unix_socket)
    snprintf(why, sizeof why, "%s: refused a connection of uid %u (pid %ld): it holds %u (%s), "
             "none idle", acceptor->name, (unsigned)cred->uid, (long)cred->pid, acceptor->limit,
             acceptor->limit_name);
  else
    snprintf(why, sizeof why, "%s: refused a connection: the port holds %u (%s), none idle",
             acceptor->name, acceptor->limit, acceptor->limit_name);
  log_warning("%s", why);
  if (acceptor->ops.turn_away)
    acceptor->ops.turn_away(acceptor->ops.data, fd, cred, why);
  close(fd);
}

/* A process that may not use the daemon: logged, then closed or handed to the owner to
 * hear why, under the same per-uid limit. */
static void refuse_credentials(fsdp_acceptor_t *acceptor, int fd, const fsdp_credentials_t *cred) {
  log_warning("%s: refused a connection from pid %ld uid %u gid %u: not the daemon's user or "
              "group", acceptor->name, (long)cred->pid, (unsigned)cred->uid, (unsigned)cred->gid);
  fsdp_accepted_t *conn = acceptor->ops.adopt_refused ? admit(acceptor, fd, cred) : NULL;
  if (!conn) {
    close(fd);
    return;
  }
  if (acceptor->ops.adopt_refused(acceptor->ops.data, conn) < 0)
    fsdp_acceptor_release(conn);
}

static void on_readable(uv_poll_t *poll, int status, int events);

static void on_accept_retry(uv_timer_t *timer) {
  fsdp_acceptor_t *acceptor = timer->data;
  uv_poll_start(&acceptor->poll, UV_READABLE, on_readable);
}

/* The next pending connection, or -1 when there is none for now (EAGAIN) or no descriptor
 * to take it with (then accepting pauses). */
static int accept_next(fsdp_acceptor_t *acceptor) {
  int fd = accept4(acceptor->fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
  if (fd < 0) {
    if (errno == EMFILE || errno == ENFILE) {
      if (!acceptor->starved)
        log_warning("cannot accept on %s: %s; retrying every %d ms", acceptor->name,
                    strerror(errno), ACCEPT_RETRY_MS);
      acceptor->starved = true;
      uv_poll_stop(&acceptor->poll);
      uv_timer_start(&acceptor->retry, on_accept_retry, ACCEPT_RETRY_MS, 0);
    }
    return -1;
  }
  if (acceptor->starved) {
    log_info("accepting on %s again", acceptor->name);
    acceptor->starved = false;
  }
  return fd;
}

static void on_readable(uv_poll_t *poll, int status, int events) {
  (void)events;
  fsdp_acceptor_t *acceptor = poll->data;
  if (status < 0) {
    log_error("socket %s: %s", acceptor->name, uv_strerror(status));
    return;
  }
  int fd;
  while ((fd = accept_next(acceptor)) >= 0) {
    fsdp_credentials_t cred = {0};
    if (acceptor->unix_socket &&
        (fsdp_peer_credentials(fd, &cred.pid, &cred.uid, &cred.gid) < 0 ||
         !fsdp_credentials_allowed(fd, &cred))) {
      refuse_credentials(acceptor, fd, &cred);
      continue;
    }
    fsdp_accepted_t *conn = admit(acceptor, fd, &cred);
    if (!conn) {
      refuse_at_limit(acceptor, fd, &cred);
      continue;
    }
    if (acceptor->ops.adopt(acceptor->ops.data, conn) < 0)
      fsdp_acceptor_release(conn);
  }
}

void fsdp_acceptor_init(fsdp_acceptor_t *acceptor, int fd, bool unix_socket, const char *name,
                        unsigned limit, const char *limit_name, const fsdp_acceptor_ops_t *ops) {
  *acceptor = (fsdp_acceptor_t){.fd = fd, .unix_socket = unix_socket, .name = name,
                                .limit = limit, .limit_name = limit_name, .ops = *ops};
  fsdp_list_init(&acceptor->conns);
}

int fsdp_acceptor_start(fsdp_acceptor_t *acceptor, uv_loop_t *loop) {
  acceptor->loop = loop;
  int r = uv_poll_init(loop, &acceptor->poll, acceptor->fd);
  if (r < 0)
    return r;
  uv_timer_init(loop, &acceptor->retry);
  acceptor->poll.data = acceptor->retry.data = acceptor;
  acceptor->polling = true;
  return uv_poll_start(&acceptor->poll, UV_READABLE, on_readable);
}

void fsdp_acceptor_stop(fsdp_acceptor_t *acceptor) {
  if (acceptor->polling) {
    uv_poll_stop(&acceptor->poll);
    uv_close((uv_handle_t *)&acceptor->poll, NULL);
    uv_close((uv_handle_t *)&acceptor->retry, NULL);
    acceptor->polling = false;
  }
  while (!fsdp_list_empty(&acceptor->conns))
    fsdp_acceptor_release(fsdp_list_first(&acceptor->conns, fsdp_accepted_t, link));
}
