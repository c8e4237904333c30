/* The server's endpoints: each its own gRPC server with its services' methods registered,
 * its token and TLS credentials, and the connections adopted into it, counted by
 * descriptor so that the listener can tell idle connections and a connection piling up
 * calls is cut. Apart from the server because an endpoint is set up once and then only
 * asked about. */
#include <errno.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <grpc/grpc.h>
#include <grpc/grpc_posix.h>
#include <grpc/grpc_security.h>

#include "common/log.h"
#include "daemon/rpc/rpc_internal.h"
#include "proto/wire.h"

/* CQ thread: counts the call against its connection, and cuts a connection that holds
 * more calls than it may have streams open. */
void rpc_count_connection_call(fsdp_rpc_call_t *call) {
  fsdp_rpc_server_t *server = call->server;
  int fd = rpc_peer_fd(call->call);
  if (fd < 0 || (size_t)fd >= server->n_conns)
    return;
  call->conn_fd = fd;
  conn_slot_t *slot = &server->conns[fd];
  atomic_store(&slot->proven, true);
  unsigned calls = atomic_fetch_add(&slot->calls, 1) + 1;
  if (calls > call->endpoint->max_streams_per_connection && !atomic_exchange(&slot->cut, true)) {
    /* Only if the descriptor is still that connection: gRPC may have closed it, and the
     * number may be another file's by now. */
    struct stat sb;
    if (fstat(fd, &sb) == 0 && sb.st_ino == atomic_load(&slot->ino))
      shutdown(fd, SHUT_RDWR);
    call->conn_logs_cut = true;
  }
  call->conn_cut = atomic_load(&slot->cut);
}

void rpc_endpoint_free(fsdp_rpc_endpoint_t *ep) {
  if (ep->credentials)
    grpc_server_credentials_release(ep->credentials);
  if (ep->auth_expected) {
    explicit_bzero(ep->auth_expected, strlen(ep->auth_expected));
    free(ep->auth_expected);
  }
  free(ep->methods);
  free(ep);
}

/* The endpoint's own credentials and token, from its options. */
static int endpoint_security(fsdp_rpc_endpoint_t *ep, const fsdp_rpc_endpoint_options_t *o) {
  ep->options.auth_token = ep->options.auth_name = NULL;
  ep->options.tls_cert_pem = ep->options.tls_key_pem = ep->options.tls_ca_pem = NULL;
  if (o->auth_token) {
    size_t n = strlen(o->auth_token) + sizeof "Bearer ";
    if (!(ep->auth_expected = malloc(n)))
      return -ENOMEM;
    snprintf(ep->auth_expected, n, "Bearer %s", o->auth_token);
    snprintf(ep->auth_name, sizeof ep->auth_name, "%s", o->auth_name ? o->auth_name : "the endpoint");
  }
  if (o->tls_cert_pem || o->tls_key_pem || o->tls_ca_pem) {
    if (!o->tls_cert_pem || !o->tls_key_pem || !o->tls_ca_pem)
      return -EINVAL;
    grpc_ssl_pem_key_cert_pair pair = {o->tls_key_pem, o->tls_cert_pem};
    ep->credentials = grpc_ssl_server_credentials_create_ex(
        o->tls_ca_pem, &pair, 1, GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY, NULL);
    if (!ep->credentials)
      return -EINVAL;
  }
  return 0;
}

/* An endpoint with its method table sized, and its credentials and token; no gRPC server
 * yet. */
static int endpoint_new(fsdp_rpc_server_t *server, const char *name,
                        const fsdp_rpc_service_t *services, size_t n_services,
                        const fsdp_rpc_endpoint_options_t *options,
                        fsdp_rpc_endpoint_t **ret_endpoint) {
  fsdp_rpc_endpoint_t *ep = calloc(1, sizeof *ep);
  if (!ep)
    return -ENOMEM;
  ep->server = server;
  ep->options = *options;
  snprintf(ep->name, sizeof ep->name, "%s", name);
  ep->shutdown_tag = (tag_t){TAG_SHUTDOWN, ep};
  for (size_t s = 0; s < n_services; s++)
    ep->n_methods += services[s].descriptor->n_methods;
  ep->methods = calloc(ep->n_methods ? ep->n_methods : 1, sizeof *ep->methods);
  int r = ep->methods ? endpoint_security(ep, options) : -ENOMEM;
  if (r < 0) {
    rpc_endpoint_free(ep);
    return r;
  }
  *ret_endpoint = ep;
  return 0;
}

/* gRPC refuses a message larger than the largest any method here takes before it has
 * buffered it: a port that serves only Health takes only names. */
static size_t largest_request(const fsdp_rpc_server_t *server, const fsdp_rpc_service_t *services,
                              size_t n_services) {
  size_t max_request = FSDP_WIRE_HEALTH_REQUEST_MAX; /* a name, even with no method here */
  for (size_t s = 0; s < n_services; s++)
    for (unsigned i = 0; i < services[s].descriptor->n_methods; i++) {
      size_t m = fsdp_wire_method_max_request(services[s].descriptor, i,
                                              server->options.max_message_size);
      max_request = m > max_request ? m : max_request;
    }
  return max_request;
}

/* The endpoint's gRPC server, with its limits, on the server's completion queue. */
static void create_grpc_server(fsdp_rpc_endpoint_t *ep, size_t max_request) {
  const fsdp_rpc_endpoint_options_t *options = &ep->options;
  /* Requests whose message has not arrived yet are held by gRPC, not counted by us;
   * this bounds them per connection. At the in-flight limit itself, HTTP/2 clients
   * would queue quietly instead of hearing RESOURCE_EXHAUSTED from us: hence twice. */
  ep->max_streams_per_connection = 2 * options->max_inflight_calls + options->max_streams;
  grpc_arg args[] = {
      {GRPC_ARG_INTEGER, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, {.integer = (int)max_request}},
      {GRPC_ARG_INTEGER, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, {.integer = -1}},
      /* gRPC allows SO_REUSEPORT by default: two daemons would then share one port. */
      {GRPC_ARG_INTEGER, GRPC_ARG_ALLOW_REUSEPORT, {.integer = 0}},
      {GRPC_ARG_INTEGER, GRPC_ARG_MAX_CONCURRENT_STREAMS,
       {.integer = (int)ep->max_streams_per_connection}},
      /* A connection without a call for this long is closed (GOAWAY; clients reconnect when
       * they call again): idle connections cannot pile up. */
      {GRPC_ARG_INTEGER, GRPC_ARG_MAX_CONNECTION_IDLE_MS,
       {.integer = options->idle_ms ? (int)options->idle_ms : INT32_MAX}},
      /* A TLS handshake that does not finish in time is dropped too. */
      {GRPC_ARG_INTEGER, GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
       {.integer = options->idle_ms ? (int)options->idle_ms : INT32_MAX}},
  };
  grpc_channel_args channel_args = {sizeof args / sizeof args[0], args};
  ep->grpc = grpc_server_create(&channel_args, NULL);
  grpc_server_register_completion_queue(ep->grpc, rpc_queue(ep->server), NULL);
}

/* Puts the service's handlers on its methods, which start at ep->methods[first]. */
static int bind_handlers(fsdp_rpc_endpoint_t *ep, const fsdp_rpc_service_t *service,
                         size_t first) {
  const ProtobufCServiceDescriptor *sd = service->descriptor;
  for (size_t h = 0; h < service->n_handlers; h++) {
    const ProtobufCMethodDescriptor *md =
        protobuf_c_service_descriptor_get_method_by_name(sd, service->handlers[h].method);
    if (!md) {
      log_error("%s has no method '%s' to handle", sd->name, service->handlers[h].method);
      return -EINVAL;
    }
    method_t *m = &ep->methods[first + (size_t)(md - sd->methods)];
    m->handler = service->handlers[h].fn;
    m->while_draining = service->handlers[h].while_draining;
  }
  return 0;
}

/* Registers every method of the service with gRPC, from ep->methods[first] on. */
static int register_methods(fsdp_rpc_endpoint_t *ep, const fsdp_rpc_service_t *service,
                            size_t first) {
  const ProtobufCServiceDescriptor *sd = service->descriptor;
  for (unsigned i = 0; i < sd->n_methods; i++) {
    method_t *m = &ep->methods[first + i];
    m->endpoint = ep;
    m->service = service;
    m->index = i;
    m->streaming = fsdp_wire_method_is_server_streaming(sd, i);
    m->max_request = fsdp_wire_method_max_request(sd, i, ep->server->options.max_message_size);
    fsdp_wire_method_path(sd, i, m->path, sizeof m->path);
    m->registration = grpc_server_register_method(ep->grpc, m->path, NULL,
                                                  GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    if (!m->registration) {
      log_error("cannot register %s on the %s endpoint", m->path, ep->name);
      return -EINVAL;
    }
  }
  return 0;
}

int fsdp_rpc_server_add_endpoint(fsdp_rpc_server_t *server, const char *name,
                                 const fsdp_rpc_service_t *services, size_t n_services,
                                 const fsdp_rpc_endpoint_options_t *options,
                                 fsdp_rpc_endpoint_t **ret_endpoint) {
  fsdp_rpc_endpoint_t *ep;
  int r = endpoint_new(server, name, services, n_services, options, &ep);
  if (r < 0)
    return r;
  create_grpc_server(ep, largest_request(server, services, n_services));
  size_t first = 0;
  for (size_t s = 0; s < n_services; s++) {
    if (bind_handlers(ep, &services[s], first) < 0 ||
        register_methods(ep, &services[s], first) < 0) {
      grpc_server_destroy(ep->grpc);
      rpc_endpoint_free(ep);
      return -EINVAL;
    }
    first += services[s].descriptor->n_methods;
  }
  ep->next = server->endpoints;
  server->endpoints = ep;
  *ret_endpoint = ep;
  return 0;
}

int fsdp_rpc_endpoint_listen(fsdp_rpc_endpoint_t *endpoint, const char *address,
                             int *ret_port, fsdp_status_t *st) {
  int port = grpc_server_add_http2_port(endpoint->grpc, address,
                                        endpoint->credentials ? endpoint->credentials
                                                              : endpoint->server->credentials);
  if (port <= 0)
    return fsdp_status_set(st, -EADDRINUSE,
                           "cannot listen on %s for the %s endpoint: address in use or invalid",
                           address, endpoint->name);
  *ret_port = port;
  return 0;
}

void fsdp_rpc_endpoint_adopt(fsdp_rpc_endpoint_t *endpoint, int fd, const char *peer_name) {
  server_state_t state = endpoint->server->state;
  if (state != SERVER_RUNNING && state != SERVER_STOP_DRAINING) {
    close(fd);
    return;
  }
  struct stat sb;
  if ((size_t)fd < endpoint->server->n_conns && fstat(fd, &sb) == 0) {
    conn_slot_t *slot = &endpoint->server->conns[fd];
    atomic_store(&slot->ino, sb.st_ino);
    atomic_store(&slot->cut, false);
    atomic_store(&slot->proven, false);
    atomic_store(&slot->authenticated, false);
    free(slot->name);
    slot->name = peer_name ? strdup(peer_name) : NULL;
  }
  grpc_server_add_channel_from_fd(endpoint->grpc, fd, endpoint->server->credentials);
}

unsigned fsdp_rpc_endpoint_max_streams_per_connection(const fsdp_rpc_endpoint_t *endpoint) {
  return endpoint->max_streams_per_connection;
}

unsigned fsdp_rpc_endpoint_connection_calls(const fsdp_rpc_endpoint_t *endpoint, int fd) {
  const fsdp_rpc_server_t *server = endpoint->server;
  return fd >= 0 && (size_t)fd < server->n_conns ? atomic_load(&server->conns[fd].calls) : 0;
}

bool fsdp_rpc_endpoint_connection_proven(const fsdp_rpc_endpoint_t *endpoint, int fd) {
  const fsdp_rpc_server_t *server = endpoint->server;
  return fd >= 0 && (size_t)fd < server->n_conns && atomic_load(&server->conns[fd].proven);
}

bool fsdp_rpc_endpoint_connection_authenticated(const fsdp_rpc_endpoint_t *endpoint, int fd) {
  const fsdp_rpc_server_t *server = endpoint->server;
  return fd >= 0 && (size_t)fd < server->n_conns &&
         atomic_load(&server->conns[fd].authenticated);
}

bool fsdp_rpc_endpoint_connection_trusted(const fsdp_rpc_endpoint_t *endpoint, int fd) {
  return endpoint->auth_expected ? fsdp_rpc_endpoint_connection_authenticated(endpoint, fd)
                                 : fsdp_rpc_endpoint_connection_proven(endpoint, fd);
}

void fsdp_rpc_endpoint_set_max_inflight(fsdp_rpc_endpoint_t *endpoint,
                                        unsigned max_inflight_calls) {
  endpoint->options.max_inflight_calls = max_inflight_calls;
}
