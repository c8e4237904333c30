/* The endpoints the daemon serves besides its unix socket (the TCP health port, the peer
 * port with its token or TLS) and their limits, and the descriptors those limits need. */
#include "daemon/internal.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>

#include "common/log.h"
#include "daemon/services/fastpath.h"
#include "daemon/services/metrics.h"
#include "daemon/services/status_page.h"

/* Calls the TCP health endpoint holds at once. */
#define HEALTH_MAX_INFLIGHT 64
/* The peer port answers the other daemons: a Join, a Heartbeat and a Leave each at most. */
#define PEER_MAX_INFLIGHT 256
/* Client resets one health port connection may send within the relay's window: a probe
 * resets a stream only when its deadline passes. */
#define HEALTH_MAX_RESETS 64
/* Resets a peer port connection may send before a call on it carried the token: a peer's
 * first call does, long before a deadline of it could pass, and a probe without the token
 * is refused at once, so only a flood resets streams there. */
#define PEER_MAX_RESETS_UNTRUSTED 8
/* Connections the plaintext peer port holds at once: each other host's channel, and one it
 * left behind when it restarted until that one is found closed, plus probes. */
#define PEER_CONNECTIONS_PER_HOST 2
#define PEER_CONNECTIONS_EXTRA 16

/* "127.0.0.1:0" listened on port 41234 -> "127.0.0.1:41234". */
static void format_bound_address(char *buf, size_t size, const char *address, int port) {
  const char *colon = strrchr(address, ':');
  int host_len = colon ? (int)(colon - address) : (int)strlen(address);
  snprintf(buf, size, "%.*s:%d", host_len, address, port);
}

/* Client resets one peer port connection may send within the relay's window. A peer's
 * client resets a stream only when a call's deadline passes: it holds at most one Join and
 * one Heartbeat in flight, each with a deadline of peer.timeout, which no daemon sets below
 * the option's minimum (50 ms), and sends one Leave as it stops. So a peer resets at most
 * 2 * 10 s / 50 ms + 1 = 401 streams in 10 s, and with the default peer.timeout (5 s) 5. The
 * relay counts resets when it reads them, so a loop that stalled reads a backlog at once:
 * but a peer that hears nothing for peer.timeout counts this host lost and stops its
 * Heartbeats, and its Joins back off to one a second, so only a stall of minutes brings
 * this many into one read (and then the peer reconnects). A rapid-reset client sends
 * thousands a second. */
static unsigned peer_max_resets(void) {
  unsigned shortest_deadline_ms = (unsigned)fsdp_option_get(FSDP_OPTION_PEER_TIMEOUT)->min;
  return 2 * FSDP_RELAY_RESET_WINDOW_MS / shortest_deadline_ms + 1;
}

static unsigned peer_max_connections(const fsdp_config_t *cfg) {
  return PEER_CONNECTIONS_PER_HOST * fsdp_config_host_count(cfg) + PEER_CONNECTIONS_EXTRA;
}

/* The metrics endpoint and status page (HTTP, libmicrohttpd on the loop) when metrics.listen
 * names one. */
static int start_metrics(fsdp_daemon_t *daemon, const char *address, fsdp_status_t *st) {
  if (!address[0])
    return 0;
  return fsdp_metrics_http_start(&daemon->loop, address, fsdp_services_render_metrics,
                                 fsdp_services_render_page, &daemon->handlers, &daemon->metrics,
                                 daemon->metrics_address, sizeof daemon->metrics_address, st);
}

/* The Peer service on its own TCP port, with the token and TLS of the peer.* keys; only
 * when there are peers. A plaintext port (token or peer.insecure) is accepted by the
 * listener and relayed, like the health port: a client without the token reaches gRPC all
 * the same, and could reset streams faster than gRPC 1.51 can stop. With mutual TLS gRPC
 * accepts the port itself: the handshake wants a client certificate before any HTTP/2
 * frame, so only a holder of one could try. */
static int create_peer_endpoint(fsdp_daemon_t *daemon, fsdp_status_t *st) {
  const fsdp_config_t *cfg = &daemon->config;
  if (fsdp_config_host_count(cfg) < 2)
    return 0;
  const fsdp_peer_security_t *sec = &daemon->peer_security;
  fsdp_rpc_endpoint_options_t options = {
      .max_inflight_calls = PEER_MAX_INFLIGHT,
      .limit_name = "the peer port's fixed limit",
      .max_streams = (unsigned)fsdp_config_number(cfg, FSDP_OPTION_MAX_STREAMS),
      .streams_limit_name = "rpc.max_streams",
      .idle_ms = (unsigned)fsdp_config_number(cfg, FSDP_OPTION_IDLE_TIMEOUT),
      .auth_token = sec->token,
      .auth_name = "peer.token_file",
      .tls_cert_pem = sec->tls_cert,
      .tls_key_pem = sec->tls_key,
      .tls_ca_pem = sec->tls_ca,
  };
  /* HEALTH and PEER are adjacent: probes can ask for fsdp.v1.Peer where it is served. */
  int r = fsdp_rpc_server_add_endpoint(daemon->rpc, "peer", &daemon->services[FSDP_SERVICE_HEALTH],
                                       2, &options, &daemon->peer_endpoint);
  if (r < 0)
    return fsdp_status_set(st, r == -EINVAL && sec->tls_cert ? FSDP_E_CONFIG : r,
                           "cannot set up the peer endpoint: %s%s", fsdp_strerror(r),
                           sec->tls_cert ? " (check peer.tls_cert, peer.tls_key, peer.tls_ca)"
                                         : "");
  char listen[320];
  const char *configured = fsdp_config_text(cfg, FSDP_OPTION_PEER_LISTEN);
  if (configured[0])
    snprintf(listen, sizeof listen, "%s", configured);
  else
    fsdp_config_host(cfg, (unsigned)fsdp_config_number(cfg, FSDP_OPTION_CLUSTER_HOST_RANK),
                     listen, sizeof listen);
  if (!sec->tls_cert) {
    fsdp_listener_tcp_options_t tcp = {
        .what = "peer",
        .endpoint = daemon->peer_endpoint,
        .max_connections = peer_max_connections(cfg),
        .limit_name = "the peer port's fixed limit",
        .max_streams = fsdp_rpc_endpoint_max_streams_per_connection(daemon->peer_endpoint),
        .max_resets = peer_max_resets(),
        .max_resets_untrusted = PEER_MAX_RESETS_UNTRUSTED,
    };
    if ((r = fsdp_listener_listen_tcp(&daemon->listener, FSDP_LISTENER_PEER, listen, &tcp,
                                      st)) < 0)
      return r;
    snprintf(daemon->peer_address, sizeof daemon->peer_address, "%s",
             daemon->listener.tcp[FSDP_LISTENER_PEER].address);
    return 0;
  }
  int port;
  if ((r = fsdp_rpc_endpoint_listen(daemon->peer_endpoint, listen, &port, st)) < 0)
    return r;
  format_bound_address(daemon->peer_address, sizeof daemon->peer_address, listen, port);
  return 0;
}

int daemon_create_rpc(fsdp_daemon_t *daemon, fsdp_status_t *st) {
  const fsdp_config_t *cfg = &daemon->config;
  fsdp_rpc_server_options_t options = {
      .max_message_size = (size_t)fsdp_config_number(cfg, FSDP_OPTION_MAX_MESSAGE_SIZE),
  };
  unsigned max_streams = (unsigned)fsdp_config_number(cfg, FSDP_OPTION_MAX_STREAMS);
  unsigned idle_ms = (unsigned)fsdp_config_number(cfg, FSDP_OPTION_IDLE_TIMEOUT);
  fsdp_rpc_endpoint_options_t local_options = {
      .max_inflight_calls = (unsigned)fsdp_config_number(cfg, FSDP_OPTION_MAX_INFLIGHT_CALLS),
      .limit_name = "rpc.max_inflight_calls",
      .max_streams = max_streams,
      .streams_limit_name = "rpc.max_streams",
      .idle_ms = idle_ms,
  };
  /* The TCP port answers anyone on the host: probes are short Checks and a few Watches. */
  fsdp_rpc_endpoint_options_t health_options = {
      .max_inflight_calls = HEALTH_MAX_INFLIGHT,
      .limit_name = "the health port's fixed limit",
      .max_streams = max_streams,
      .streams_limit_name = "rpc.max_streams",
      .idle_ms = idle_ms,
  };
  int r = fsdp_rpc_server_new(&daemon->loop, &options, &daemon->rpc);
  if (r < 0)
    return fsdp_status_set(st, r, "cannot create the RPC server: %s", fsdp_strerror(r));

  r = fsdp_rpc_server_add_endpoint(daemon->rpc, "local", daemon->services,
                                   FSDP_SERVICE_LOCAL_COUNT, &local_options,
                                   &daemon->local_endpoint);
  if (r < 0)
    return fsdp_status_set(st, r, "cannot set up the local endpoint: %s", fsdp_strerror(r));

  /* Serves no one: every call gets PERMISSION_DENIED saying why (fsdp_listener_refusal). */
  fsdp_rpc_endpoint_options_t refused_options = {
      .max_inflight_calls = HEALTH_MAX_INFLIGHT,
      .limit_name = "the refusal's fixed limit",
      .max_streams = 1,
      .streams_limit_name = "the refusal's fixed limit",
      .idle_ms = idle_ms,
      .refuse = fsdp_listener_refusal,
      .refuse_data = &daemon->listener,
  };
  r = fsdp_rpc_server_add_endpoint(daemon->rpc, "refused", NULL, 0, &refused_options,
                                   &daemon->refused_endpoint);
  if (r < 0)
    return fsdp_status_set(st, r, "cannot set up the refusal endpoint: %s", fsdp_strerror(r));

  const char *health_listen = fsdp_config_text(cfg, FSDP_OPTION_HEALTH_LISTEN);
  if (health_listen[0]) {
    r = fsdp_rpc_server_add_endpoint(daemon->rpc, "health",
                                     &daemon->services[FSDP_SERVICE_HEALTH], 1,
                                     &health_options,
                                     &daemon->health_endpoint);
    if (r < 0)
      return fsdp_status_set(st, r, "cannot set up the health endpoint: %s", fsdp_strerror(r));
    /* The listener accepts the port itself, as it does the unix socket. */
    fsdp_listener_tcp_options_t tcp = {
        .what = "health",
        .endpoint = daemon->health_endpoint,
        .max_connections = (unsigned)fsdp_config_number(cfg, FSDP_OPTION_HEALTH_MAX_CONNECTIONS),
        .limit_name = "health.max_connections",
        .max_streams = fsdp_rpc_endpoint_max_streams_per_connection(daemon->health_endpoint),
        .max_resets = HEALTH_MAX_RESETS,
        .max_resets_untrusted = HEALTH_MAX_RESETS,
    };
    if ((r = fsdp_listener_listen_tcp(&daemon->listener, FSDP_LISTENER_HEALTH, health_listen,
                                      &tcp, st)) < 0)
      return r;
    snprintf(daemon->health_address, sizeof daemon->health_address, "%s",
             daemon->listener.tcp[FSDP_LISTENER_HEALTH].address);
  }
  if ((r = start_metrics(daemon, fsdp_config_text(cfg, FSDP_OPTION_METRICS_LISTEN), st)) < 0)
    return r;
  return create_peer_endpoint(daemon, st);
}

/* Descriptors the limits allow the daemon to hold: each session's connection, memory channel
 * and job arenas; one uid's connections on the unix socket, the health port's and the peer
 * port's; pending memory channels; and a margin for peers, UCX, gRPC and logs. */
static uint64_t descriptors_needed(const fsdp_config_t *cfg) {
  return 3 * (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_MAX_SESSIONS) +
         (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_MAX_CONNECTIONS_PER_UID) +
         (uint64_t)fsdp_config_number(cfg, FSDP_OPTION_HEALTH_MAX_CONNECTIONS) +
         peer_max_connections(cfg) + FSDP_CHANNEL_MAX_PENDING + 256;
}

void daemon_raise_descriptor_limit(const fsdp_config_t *cfg) {
  struct rlimit nofile;
  if (getrlimit(RLIMIT_NOFILE, &nofile) < 0)
    return;
  if (nofile.rlim_cur < nofile.rlim_max) {
    rlim_t was = nofile.rlim_cur;
    nofile.rlim_cur = nofile.rlim_max;
    if (setrlimit(RLIMIT_NOFILE, &nofile) < 0)
      nofile.rlim_cur = was;
  }
  uint64_t need = descriptors_needed(cfg);
  if (nofile.rlim_cur != RLIM_INFINITY && nofile.rlim_cur < need)
    log_warning("the descriptor limit is %llu (hard limit %llu) but the configured limits need "
                "about %llu (3 per session.max_sessions, one uid's "
                "rpc.max_connections_per_uid, health.max_connections, the peer port's and the "
                "memory channel's pending connections, and a margin): raise LimitNOFILE or "
                "lower them, or trainers and probes will be refused when it runs out",
                (unsigned long long)nofile.rlim_cur, (unsigned long long)nofile.rlim_max,
                (unsigned long long)need);
  else
    log_debug("descriptor limit %llu, the configured limits need about %llu",
              (unsigned long long)nofile.rlim_cur, (unsigned long long)need);
}
