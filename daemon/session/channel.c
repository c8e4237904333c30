/* Memory channel: accept, hello, welcome with descriptors, then watch for the end. */
#include "daemon/session/channel.h"

#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fsdp/fsdp_version.h>

#include "common/fdpass.h"
#include "common/log.h"
#include "proto/wire.h"

typedef enum conn_state { CONN_HELLO, CONN_BOUND, CONN_CLOSING } conn_state_t;

struct fsdp_channel_conn {
  fsdp_channel_t *channel;
  uv_poll_t poll;
  int fd;
  fsdp_accepted_t *accepted; /* its credentials and its place under the limit, until closing */
  conn_state_t state;
  void *owner;
  fsdp_list_t link; /* in the channel's conns until it closes */
};

static void on_conn_closed(uv_handle_t *handle) {
  fsdp_channel_conn_t *conn = handle->data;
  close(conn->fd);
  free(conn);
}

void fsdp_channel_conn_close(fsdp_channel_conn_t *conn) {
  if (conn->state == CONN_CLOSING)
    return;
  fsdp_channel_t *channel = conn->channel;
  if (conn->state == CONN_HELLO)
    channel->pending--;
  conn->state = CONN_CLOSING;
  conn->owner = NULL;
  fsdp_acceptor_release(conn->accepted);
  conn->accepted = NULL;
  fsdp_list_remove(&conn->link);
  uv_poll_stop(&conn->poll);
  uv_close((uv_handle_t *)&conn->poll, on_conn_closed);
}

void fsdp_channel_conn_set_owner(fsdp_channel_conn_t *conn, void *owner) {
  conn->owner = owner;
}

/* Sends a welcome (the answer to a hello, or why the connection is closed) on fd, whose
 * process is pid; false if the connection is to be closed. */
static bool send_welcome(int fd, pid_t pid, fsdp_channel_welcome_t *w) {
  Fsdp__V1__ChannelWelcome reply = FSDP__V1__CHANNEL_WELCOME__INIT;
  bool ok = w->status.code >= 0;
  if (ok) {
    reply.n_memories = w->n;
    reply.memories = w->memories;
    reply.fast_path = w->fast_path;
    reply.n_cuda_events = w->n_cuda_events;
    reply.cuda_events = w->cuda_events;
  } else {
    reply.status = (int32_t)fsdp_wire_status_from_error(w->status.code);
    reply.message = w->status.message;
  }
  uint8_t frame[FSDP_CHANNEL_FRAME_BYTES];
  int r = fsdp_wire_frame_encode(&reply.base, frame);
  if (r == 0)
    r = fsdp_fd_send(fd, w->fds, ok ? w->n_fds : 0, frame, sizeof frame, 1000);
  if (r < 0) {
    log_warning("memory channel of pid %d: cannot send the welcome: %s", (int)pid,
                fsdp_strerror(r));
    return false;
  }
  return ok;
}

static bool answer(fsdp_channel_conn_t *conn, fsdp_channel_welcome_t *w) {
  return send_welcome(conn->fd, conn->accepted->cred.pid, w);
}

/* Tells a connection that has not said hello why it is closed (the trainer's client reads
 * the status of the welcome), and closes it. */
static void refuse(fsdp_channel_conn_t *conn, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void refuse(fsdp_channel_conn_t *conn, int code, const char *fmt, ...) {
  fsdp_channel_welcome_t w = {0};
  va_list ap;
  va_start(ap, fmt);
  fsdp_status_setv(&w.status, code, fmt, ap);
  va_end(ap);
  log_warning("%s", w.status.message);
  answer(conn, &w);
  fsdp_channel_conn_close(conn);
}

static void read_hello(fsdp_channel_conn_t *conn) {
  fsdp_channel_t *channel = conn->channel;
  uint8_t frame[FSDP_CHANNEL_FRAME_BYTES];
  ssize_t n = recv(conn->fd, frame, sizeof frame, MSG_DONTWAIT | MSG_TRUNC);
  if (n < 0 && (errno == EAGAIN || errno == EINTR))
    return;
  if (n <= 0) {
    fsdp_channel_conn_close(conn); /* gone before saying hello */
    return;
  }
  fsdp_channel_welcome_t w = {0};
  ProtobufCMessage *msg = NULL;
  if (fsdp_wire_frame_decode(&fsdp__v1__channel_hello__descriptor, frame, (size_t)n, &msg,
                             &w.status) == 0) {
    const Fsdp__V1__ChannelHello *hello = (const void *)msg;
    if (hello->protocol_version != FSDP_PROTOCOL_VERSION)
      fsdp_status_set(&w.status, FSDP_E_PROTOCOL_VERSION,
                      "memory channel: protocol_version %u from the trainer, but this fsdpd "
                      "speaks protocol %u",
                      hello->protocol_version, FSDP_PROTOCOL_VERSION);
    else
      channel->callbacks.welcome(channel->callbacks.data, conn, hello, &conn->accepted->cred,
                                 &w);
    protobuf_c_message_free_unpacked(msg, NULL);
  }
  channel->pending--;
  conn->state = CONN_BOUND;
  if (!answer(conn, &w)) {
    void *owner = conn->owner;
    fsdp_channel_conn_close(conn);
    if (owner)
      channel->callbacks.closed(channel->callbacks.data, owner, "its welcome could not be sent");
  }
}

static void on_conn_event(uv_poll_t *poll, int status, int events) {
  (void)events;
  fsdp_channel_conn_t *conn = poll->data;
  if (conn->state == CONN_HELLO && status == 0) {
    read_hello(conn);
    return;
  }
  if (conn->state != CONN_BOUND)
    return;
  /* A bound trainer never writes again: whatever happens here ends its session. */
  char byte;
  ssize_t n = recv(conn->fd, &byte, 1, MSG_DONTWAIT | MSG_PEEK);
  if (n < 0 && (errno == EAGAIN || errno == EINTR) && status == 0)
    return;
  const char *why = n == 0 ? "its process closed the memory channel (it exited or died)"
                    : n > 0 ? "it sent more on the memory channel than the protocol allows"
                            : "its memory channel failed";
  fsdp_channel_t *channel = conn->channel;
  void *owner = conn->owner;
  fsdp_channel_conn_close(conn);
  if (owner)
    channel->callbacks.closed(channel->callbacks.data, owner, why);
}

/* Connections that have not said hello are bounded in all, each uid's already by its
 * connection limit. A trainer says hello at once, so at the bound the oldest silent
 * connection of the uid holding the most goes: one user's idle connections thus cost only
 * that user, and never lock a trainer out. */
static void make_room(fsdp_channel_t *channel) {
  if (channel->pending < FSDP_CHANNEL_MAX_PENDING)
    return;
  fsdp_channel_conn_t *victim = NULL;
  unsigned top = 0;
  fsdp_channel_conn_t *c, *d;
  fsdp_list_for_each(c, &channel->conns, link) {
    if (c->state != CONN_HELLO)
      continue;
    unsigned n = 0;
    fsdp_channel_conn_t *oldest = NULL;
    fsdp_list_for_each(d, &channel->conns, link)
      if (d->state == CONN_HELLO && d->accepted->cred.uid == c->accepted->cred.uid) {
        n++;
        if (!oldest || d->accepted->since_ms <= oldest->accepted->since_ms)
          oldest = d;
      }
    if (n > top) {
      top = n;
      victim = oldest;
    }
  }
  if (victim)
    refuse(victim, FSDP_E_RESOURCE_EXHAUSTED,
           "memory channel: closed a connection of pid %d uid %u that sent no hello, to make "
           "room: its uid held %u such connections, all uids %u (at most %d)",
           (int)victim->accepted->cred.pid, (unsigned)victim->accepted->cred.uid, top,
           channel->pending, FSDP_CHANNEL_MAX_PENDING);
}

static int adopt(void *data, fsdp_accepted_t *accepted) {
  fsdp_channel_t *channel = data;
  make_room(channel);
  fsdp_channel_conn_t *conn = calloc(1, sizeof *conn);
  if (!conn) {
    close(accepted->fd);
    return -ENOMEM;
  }
  *conn = (fsdp_channel_conn_t){.channel = channel, .fd = accepted->fd, .accepted = accepted};
  int r = uv_poll_init(channel->loop, &conn->poll, conn->fd);
  if (r < 0) {
    close(conn->fd);
    free(conn);
    return r;
  }
  conn->poll.data = conn;
  accepted->owner = conn;
  channel->pending++;
  fsdp_list_push_front(&channel->conns, &conn->link);
  uv_poll_start(&conn->poll, UV_READABLE | UV_DISCONNECT, on_conn_event);
  return 0;
}

/* A bound connection holds its session; one that has not said hello may make room. */
static int idleness(void *data, const fsdp_accepted_t *accepted) {
  (void)data;
  const fsdp_channel_conn_t *conn = accepted->owner;
  return conn->state == CONN_HELLO ? 0 : FSDP_ACCEPTED_BUSY;
}

static void evict(void *data, fsdp_accepted_t *accepted, unsigned held, unsigned limit) {
  (void)data;
  refuse(accepted->owner, FSDP_E_RESOURCE_EXHAUSTED,
         "memory channel: closed a connection of pid %d uid %u that sent no hello, to make "
         "room: its uid holds %u connections (rpc.max_connections_per_uid = %u)",
         (int)accepted->cred.pid, (unsigned)accepted->cred.uid, held, limit);
}

/* A process that may not use the daemon hears why in a welcome, as a refused caller of the
 * gRPC socket does in its calls' status; then the connection ends. */
static int adopt_refused(void *data, fsdp_accepted_t *accepted) {
  (void)data;
  fsdp_channel_welcome_t w = {0};
  char why[FSDP_STATUS_MESSAGE_MAX];
  fsdp_credentials_refusal(&accepted->cred, "the memory channel", why, sizeof why);
  fsdp_status_set(&w.status, FSDP_E_PERMISSION_DENIED, "%s", why);
  send_welcome(accepted->fd, accepted->cred.pid, &w);
  close(accepted->fd);
  return -1;
}

/* Refused at the limit: the trainer's client shows the welcome's status and message. */
static void turn_away(void *data, int fd, const fsdp_credentials_t *cred, const char *why) {
  (void)data;
  fsdp_channel_welcome_t w = {0};
  fsdp_status_set(&w.status, FSDP_E_RESOURCE_EXHAUSTED, "%s", why);
  send_welcome(fd, cred->pid, &w);
}

int fsdp_channel_start(fsdp_channel_t *channel, uv_loop_t *loop, int listen_fd,
                       const fsdp_channel_callbacks_t *callbacks) {
  memset(channel, 0, sizeof *channel);
  fsdp_list_init(&channel->conns);
  channel->loop = loop;
  channel->callbacks = *callbacks;
  fsdp_acceptor_ops_t ops = {.adopt = adopt, .adopt_refused = adopt_refused,
                             .idleness = idleness, .evict = evict, .turn_away = turn_away,
                             .data = channel};
  fsdp_acceptor_init(&channel->acceptor, listen_fd, true, "memory channel", 0,
                     "rpc.max_connections_per_uid", &ops);
  return fsdp_acceptor_start(&channel->acceptor, loop);
}

void fsdp_channel_stop(fsdp_channel_t *channel) {
  while (!fsdp_list_empty(&channel->conns))
    fsdp_channel_conn_close(fsdp_list_first(&channel->conns, fsdp_channel_conn_t, link));
  fsdp_acceptor_stop(&channel->acceptor);
}

void fsdp_channel_expire(fsdp_channel_t *channel, uint64_t now_ms) {
  fsdp_channel_conn_t *conn, *next;
  fsdp_list_for_each_safe(conn, next, &channel->conns, link) {
    if (conn->state == CONN_HELLO &&
        now_ms - conn->accepted->since_ms >= FSDP_CHANNEL_HELLO_TIMEOUT_MS)
      refuse(conn, FSDP_E_DEADLINE_EXCEEDED,
             "memory channel of pid %d: no hello within %d ms; closed",
             (int)conn->accepted->cred.pid, FSDP_CHANNEL_HELLO_TIMEOUT_MS);
  }
}
