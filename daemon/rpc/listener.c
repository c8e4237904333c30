/* Run directory, lock file, unix socket and credential-checked accept. */
#include "daemon/rpc/listener.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include "common/fdpass.h"
#include "common/log.h"
#include "common/tcp_listen.h"

/* Creates or checks the run dir; resolves it to an absolute path in listener->run_dir. */
static int prepare_run_dir(fsdp_listener_t *listener, const char *run_dir, fsdp_status_t *st) {
  struct stat sb;
  if (lstat(run_dir, &sb) < 0) {
    if (errno != ENOENT)
      return fsdp_status_set(st, -errno, "run dir '%s': %s", run_dir, strerror(errno));
    if (mkdir(run_dir, 0750) < 0)
      return fsdp_status_set(st, -errno, "cannot create run dir '%s': %s", run_dir,
                             strerror(errno));
    if (lstat(run_dir, &sb) < 0)
      return fsdp_status_set(st, -errno, "run dir '%s': %s", run_dir, strerror(errno));
  }
  if (S_ISLNK(sb.st_mode))
    return fsdp_status_set(st, -ELOOP, "run dir '%s' is a symlink; refusing to follow it",
                           run_dir);
  if (!S_ISDIR(sb.st_mode))
    return fsdp_status_set(st, -ENOTDIR, "run dir '%s' is not a directory", run_dir);
  if (sb.st_uid != geteuid())
    return fsdp_status_set(st, -EPERM, "run dir '%s' is owned by uid %u, not by the daemon's uid %u",
                           run_dir, (unsigned)sb.st_uid, (unsigned)geteuid());
  if ((sb.st_mode & 07777) != 0750) {
    if (chmod(run_dir, 0750) < 0)
      return fsdp_status_set(st, -errno, "cannot set mode 0750 on run dir '%s': %s", run_dir,
                             strerror(errno));
    log_warning("run dir '%s' had mode %04o; set it to 0750", run_dir,
                (unsigned)(sb.st_mode & 07777));
  }
  if (!realpath(run_dir, listener->run_dir))
    return fsdp_status_set(st, -errno, "run dir '%s': %s", run_dir, strerror(errno));
  return 0;
}

static int take_lock(fsdp_listener_t *listener, fsdp_status_t *st) {
  char path[sizeof listener->run_dir + sizeof FSDP_LOCK_NAME + 1];
  snprintf(path, sizeof path, "%s/%s", listener->run_dir, FSDP_LOCK_NAME);
  int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0640);
  if (fd < 0)
    return fsdp_status_set(st, -errno, "lock file '%s': %s", path, strerror(errno));
  if (flock(fd, LOCK_EX | LOCK_NB) < 0) {
    int err = errno;
    char owner[32] = "";
    ssize_t n = pread(fd, owner, sizeof owner - 1, 0);
    owner[n > 0 ? n : 0] = '\0';
    owner[strcspn(owner, "\n")] = '\0';
    close(fd);
    if (err == EWOULDBLOCK)
      return fsdp_status_set(st, -EBUSY, "run dir '%s' is in use by another fsdpd (pid %s)",
                             listener->run_dir, owner[0] ? owner : "unknown");
    return fsdp_status_set(st, -err, "cannot lock '%s': %s", path, strerror(err));
  }
  char pid[32];
  int len = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
  if (ftruncate(fd, 0) < 0 || pwrite(fd, pid, (size_t)len, 0) != len)
    log_warning("cannot record the pid in '%s': %s", path, strerror(errno));
  listener->lock_fd = fd;
  return 0;
}

/* Removes a socket left by a daemon that died; we hold the lock, so it cannot be live. */
static int remove_stale_socket(const char *path, fsdp_status_t *st) {
  struct stat sb;
  if (lstat(path, &sb) < 0)
    return errno == ENOENT ? 0 : fsdp_status_set(st, -errno, "'%s': %s", path, strerror(errno));
  if (!S_ISSOCK(sb.st_mode))
    return fsdp_status_set(st, -EEXIST, "'%s' exists and is not a socket; refusing to remove it",
                           path);
  if (sb.st_uid != geteuid())
    return fsdp_status_set(st, -EPERM, "stale socket '%s' is owned by uid %u; refusing to remove it",
                           path, (unsigned)sb.st_uid);
  if (unlink(path) < 0)
    return fsdp_status_set(st, -errno, "cannot remove stale socket '%s': %s", path,
                           strerror(errno));
  log_info("removed stale socket %s", path);
  return 0;
}

/* Binds run_dir/name as a listening unix socket of `type`, mode 0660; its path goes to
 * ret_path (sun_path's size). */
static int bind_socket(const fsdp_listener_t *listener, const char *name, int type,
                       char *ret_path, int *ret_fd, fsdp_status_t *st) {
  struct sockaddr_un addr = {.sun_family = AF_UNIX};
  int n = snprintf(addr.sun_path, sizeof addr.sun_path, "%s/%s", listener->run_dir, name);
  if (n < 0 || (size_t)n >= sizeof addr.sun_path)
    return fsdp_status_set(st, -ENAMETOOLONG,
                           "socket path '%s/%s' is longer than the %zu bytes a unix socket allows",
                           listener->run_dir, name, sizeof addr.sun_path - 1);
  memcpy(ret_path, addr.sun_path, sizeof addr.sun_path);
  int r = remove_stale_socket(addr.sun_path, st);
  if (r < 0)
    return r;
  int fd = socket(AF_UNIX, type | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return fsdp_status_set(st, -errno, "socket: %s", strerror(errno));
  /* The umask makes the file 0660 at birth; chmod states it regardless of the umask. */
  mode_t old_mask = umask(0117);
  r = bind(fd, (struct sockaddr *)&addr, sizeof addr);
  umask(old_mask);
  if (r < 0 || chmod(addr.sun_path, 0660) < 0 || listen(fd, SOMAXCONN) < 0) {
    int err = errno;
    close(fd);
    return fsdp_status_set(st, -err, "cannot listen on '%s': %s", addr.sun_path, strerror(err));
  }
  *ret_fd = fd;
  return 0;
}

int fsdp_listener_open(fsdp_listener_t *listener, const char *run_dir, fsdp_status_t *st) {
  memset(listener, 0, sizeof *listener);
  /* Every socket's list is valid from here, so that fsdp_listener_close may walk them. */
  fsdp_list_init(&listener->local.acceptor.conns);
  for (int i = 0; i < FSDP_LISTENER_PORTS; i++)
    fsdp_list_init(&listener->tcp[i].acceptor.conns);
  listener->lock_fd = listener->socket_fd = listener->channel_fd = -1;
  int r = prepare_run_dir(listener, run_dir, st);
  if (r < 0)
    return r;
  r = take_lock(listener, st);
  if (r < 0)
    return r;
  r = bind_socket(listener, FSDP_SOCKET_NAME, SOCK_STREAM, listener->socket_path,
                  &listener->socket_fd, st);
  if (r == 0)
    r = bind_socket(listener, FSDP_CHANNEL_SOCKET_NAME, SOCK_SEQPACKET, listener->channel_path,
                    &listener->channel_fd, st);
  if (r < 0)
    fsdp_listener_close(listener);
  return r;
}

/* Records the credentials of an accepted unix connection by descriptor. */
static bool record_caller(fsdp_listener_t *listener, int fd, const fsdp_credentials_t *cred,
                          bool refused) {
  if ((size_t)fd >= listener->n_callers) {
    size_t n = (size_t)fd * 2 + 16;
    fsdp_listener_caller_t *grown = realloc(listener->callers, n * sizeof *grown);
    if (!grown)
      return false;
    memset(grown + listener->n_callers, 0, (n - listener->n_callers) * sizeof *grown);
    listener->callers = grown;
    listener->n_callers = n;
  }
  listener->callers[fd] = (fsdp_listener_caller_t){.cred = *cred, .refused = refused};
  return true;
}

/* A connection of the unix socket: to gRPC, its credentials kept for the calls. */
static int adopt_local(void *data, fsdp_accepted_t *conn) {
  fsdp_listener_socket_t *ls = data;
  if (!record_caller(ls->listener, conn->fd, &conn->cred, false)) {
    log_warning("out of memory recording a connection; closing it");
    close(conn->fd);
    return -ENOMEM;
  }
  fsdp_rpc_endpoint_adopt(ls->endpoint, conn->fd, NULL);
  return 0;
}

/* A gRPC client shows only "broken pipe" for a closed connection: let it in where every
 * call hears PERMISSION_DENIED and why. */
static int adopt_refused(void *data, fsdp_accepted_t *conn) {
  fsdp_listener_socket_t *ls = data;
  if (!record_caller(ls->listener, conn->fd, &conn->cred, true)) {
    close(conn->fd);
    return -ENOMEM;
  }
  fsdp_rpc_endpoint_adopt(ls->refused, conn->fd, NULL);
  return 0;
}

/* A relayed connection ended, whoever ended it. */
static void on_relay_closed(fsdp_relay_t *relay, void *data) {
  (void)relay;
  fsdp_acceptor_release(data);
}

/* A connection of a TCP port: to gRPC through a relay, which says when it ends. */
static int adopt_tcp(void *data, fsdp_accepted_t *conn) {
  fsdp_listener_socket_t *ls = data;
  fsdp_relay_t *relay;
  int r = fsdp_relay_start(ls->listener->loop, conn->fd, ls->endpoint, &ls->relay,
                           on_relay_closed, conn, &relay);
  if (r < 0) {
    log_warning("%s: cannot relay a connection: %s", ls->acceptor.name, strerror(-r));
    return r;
  }
  conn->owner = relay;
  return 0;
}

/* Idle: no call the endpoint serves. A stream whose request never came whole is no such
 * call: gRPC would hold it for ever, and a connection of those must not keep a newcomer
 * out. A connection that proved it holds the token (a peer's channel, idle between
 * heartbeats) never makes room for a newcomer, who has proved nothing; one that never
 * carried a call goes before one that did (a prober's, idle between probes). */
static int idleness(void *data, const fsdp_accepted_t *conn) {
  fsdp_listener_socket_t *ls = data;
  int served = conn->owner ? fsdp_relay_served_fd(conn->owner) : conn->fd;
  if (fsdp_rpc_endpoint_connection_calls(ls->endpoint, served) != 0 ||
      fsdp_rpc_endpoint_connection_authenticated(ls->endpoint, served))
    return FSDP_ACCEPTED_BUSY;
  return fsdp_rpc_endpoint_connection_proven(ls->endpoint, served) ? 1 : 0;
}

static void evict(void *data, fsdp_accepted_t *idle, unsigned held, unsigned limit) {
  fsdp_listener_socket_t *ls = data;
  char who[128];
  if (idle->owner)
    snprintf(who, sizeof who, "from %s", fsdp_relay_client_name(idle->owner));
  else
    snprintf(who, sizeof who, "fd %d", idle->fd);
  log_info("%s: closed an idle connection (%s) to make room: %s holds %u of %u",
           ls->acceptor.name, who, ls->tcp ? "the port" : "its uid", held, limit);
  if (idle->owner) {
    fsdp_relay_close(idle->owner);
  } else {
    /* gRPC sees the end of the stream and closes its side; the descriptor is its own. */
    shutdown(idle->fd, SHUT_RDWR);
    fsdp_acceptor_release(idle);
  }
}

int fsdp_listener_listen_tcp(fsdp_listener_t *listener, fsdp_listener_port_t port,
                             const char *address, const fsdp_listener_tcp_options_t *options,
                             fsdp_status_t *st) {
  int fd;
  char bound[sizeof listener->tcp[port].address];
  int r = fsdp_tcp_listen(address, options->what, &fd, bound, sizeof bound, st);
  if (r < 0)
    return r;
  fsdp_listener_socket_t *ls = &listener->tcp[port];
  *ls = (fsdp_listener_socket_t){.listener = listener, .tcp = true,
                                 .endpoint = options->endpoint};
  snprintf(ls->address, sizeof ls->address, "%s", bound);
  snprintf(ls->port, sizeof ls->port, "%s port", options->what);
  ls->relay = (fsdp_relay_limits_t){.port = ls->port, .max_streams = options->max_streams,
                                    .max_resets = options->max_resets,
                                    .max_resets_untrusted = options->max_resets_untrusted};
  fsdp_acceptor_ops_t ops = {.adopt = adopt_tcp, .idleness = idleness, .evict = evict,
                             .data = ls};
  fsdp_acceptor_init(&ls->acceptor, fd, false, ls->address, options->max_connections,
                     options->limit_name, &ops);
  return 0;
}

void fsdp_listener_refusal(void *data, int fd, char *buf, size_t size) {
  fsdp_listener_t *listener = data;
  if (fd < 0 || (size_t)fd >= listener->n_callers || !listener->callers[fd].refused) {
    snprintf(buf, size, "this connection may not use fsdpd");
    return;
  }
  fsdp_credentials_refusal(&listener->callers[fd].cred, listener->socket_path, buf, size);
}

int fsdp_listener_start(fsdp_listener_t *listener, uv_loop_t *loop, fsdp_rpc_endpoint_t *local,
                        fsdp_rpc_endpoint_t *refused) {
  listener->loop = loop;
  fsdp_listener_socket_t *ls = &listener->local;
  *ls = (fsdp_listener_socket_t){.listener = listener, .endpoint = local, .refused = refused};
  /* Its limit comes with the config (rpc.max_connections_per_uid), before the loop runs. */
  fsdp_acceptor_ops_t ops = {.adopt = adopt_local, .adopt_refused = refused ? adopt_refused : NULL,
                             .idleness = idleness, .evict = evict, .data = ls};
  fsdp_acceptor_init(&ls->acceptor, listener->socket_fd, true, listener->socket_path, 0,
                     "rpc.max_connections_per_uid", &ops);
  int r = fsdp_acceptor_start(&ls->acceptor, loop);
  for (int i = 0; r == 0 && i < FSDP_LISTENER_PORTS; i++)
    if (listener->tcp[i].tcp)
      r = fsdp_acceptor_start(&listener->tcp[i].acceptor, loop);
  return r;
}

static void stop_socket(fsdp_listener_socket_t *ls) {
  fsdp_accepted_t *c;
  fsdp_list_for_each(c, &ls->acceptor.conns, link)
    if (c->owner) {
      /* The relay outlives the list: it must not reach for its entry when it closes. */
      fsdp_relay_forget(c->owner);
      fsdp_relay_close(c->owner);
    }
  fsdp_acceptor_stop(&ls->acceptor);
}

int fsdp_listener_credentials(const fsdp_listener_t *listener, int fd,
                              fsdp_credentials_t *ret_cred) {
  if (fd < 0 || (size_t)fd >= listener->n_callers || listener->callers[fd].cred.pid == 0 ||
      listener->callers[fd].refused)
    return -ENOENT;
  *ret_cred = listener->callers[fd].cred;
  return 0;
}

void fsdp_listener_close(fsdp_listener_t *listener) {
  stop_socket(&listener->local);
  for (int i = 0; i < FSDP_LISTENER_PORTS; i++) {
    fsdp_listener_socket_t *ls = &listener->tcp[i];
    stop_socket(ls);
    if (ls->tcp && ls->acceptor.fd >= 0)
      close(ls->acceptor.fd);
    ls->acceptor.fd = -1;
  }
  free(listener->callers);
  listener->callers = NULL;
  listener->n_callers = 0;
  if (listener->socket_fd >= 0) {
    unlink(listener->socket_path);
    close(listener->socket_fd);
    listener->socket_fd = -1;
  }
  if (listener->channel_fd >= 0) {
    unlink(listener->channel_path);
    close(listener->channel_fd);
    listener->channel_fd = -1;
  }
  if (listener->lock_fd >= 0) {
    close(listener->lock_fd); /* releases the flock */
    listener->lock_fd = -1;
  }
}
