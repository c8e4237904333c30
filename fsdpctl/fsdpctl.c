/* fsdpctl: the operator's command-line tool for fsdpd. It asks the daemon through the client
 * library and prints aligned tables for people or one JSON object (--json) for scripts. The
 * exit status is part of the interface (see usage() and docs/fsdpctl.md): monitoring relies
 * on 3 meaning "reachable but not serving", distinct from 1 "could not ask". */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <json-c/json.h>

#include <fsdp/fsdp_client.h>
#include <fsdp/fsdp_error.h>
#include <fsdp/fsdp_version.h>

#include "client/client_rpc.h"
#include "fsdp/v1/operator.pb-c.h"
#include "fsdpctl/export.h"
#include "fsdpctl/trace.h"
#include "proto/limits.h"
#include "proto/wire.h"

enum {
  EXIT_OK = 0,
  EXIT_ERROR = 1,       /* daemon unreachable, RPC failed */
  EXIT_USAGE = 2,       /* bad option or command */
  EXIT_NOT_SERVING = 3, /* health not SERVING, or the daemon is DRAINING */
};

#define DEFAULT_TIMEOUT_MS 5000
/* Longer deadlines are surely a typo; they also keep milliseconds inside an int. */
#define MAX_TIMEOUT_MS (24 * 3600 * 1000)

typedef struct ctl {
  const char *socket;
  const char *address;
  bool json;
  bool verbose;
  const char *job; /* --job: units and unit look in this job only */
  /* export's: --out, --dtype, --step (NULL: the newest) */
  const char *out;
  fsdp_dtype_t dtype;
  const char *step;
  uint64_t steps; /* trace's --steps: the last K steps; 0: all */
  int timeout_ms;
  char *target;
  fsdp_client_t *client;
} ctl_t;

typedef struct command {
  const char *name;
  const char *sub; /* second word ("config show"), or NULL */
  int max_args;    /* operands after the command words */
  const char *args;
  const char *help;
  int (*run)(ctl_t *ctl, int argc, char **argv);
  bool offline; /* needs no daemon */
} command_t;

static void usage(FILE *out);

__attribute__((format(printf, 1, 2))) static int usage_error(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("fsdpctl: ", stderr);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fputs("\nusage: fsdpctl [--socket PATH | --address HOST:PORT] [--json] [--timeout DURATION] "
        "COMMAND\n(fsdpctl help lists the commands)\n",
        stderr);
  return EXIT_USAGE;
}

/* "NOT_FOUND" for FSDP_E_NOT_FOUND: the status names people know from gRPC. */
static const char *code_name(int code) {
  const char *name = fsdp_error_name(code);
  if (name && strncmp(name, "FSDP_E_", 7) == 0)
    return name + 7;
  return fsdp_strerror(code);
}

/* The one error line: "fsdpctl: <method>: <status name>: <message>". */
static int rpc_error(const ctl_t *ctl, const char *method, int code) {
  const char *message = fsdp_client_last_error(ctl->client);
  fprintf(stderr, "fsdpctl: %s: %s: %s\n", method, code_name(code),
          *message ? message : fsdp_strerror(code));
  if (code == FSDP_E_UNIMPLEMENTED && ctl->address)
    fprintf(stderr, "fsdpctl: the TCP listener at %s serves only grpc.health.v1.Health; "
                    "use --socket for this command\n",
            ctl->address);
  return EXIT_ERROR;
}

static int operator_call(ctl_t *ctl, const char *method, const ProtobufCMessage *request,
                         const ProtobufCMessageDescriptor *reply_desc,
                         ProtobufCMessage **ret_reply) {
  const ProtobufCServiceDescriptor *sd = &fsdp__v1__operator__descriptor;
  const ProtobufCMethodDescriptor *md = protobuf_c_service_descriptor_get_method_by_name(sd, method);
  char path[FSDP_WIRE_PATH_MAX];
  if (!md || fsdp_wire_method_path(sd, (unsigned)(md - sd->methods), path, sizeof path) < 0) {
    fprintf(stderr, "fsdpctl: fsdp.v1.Operator has no method %s\n", method);
    return FSDP_E_INTERNAL;
  }
  return fsdp_client_call(ctl->client, path, request, reply_desc, ctl->timeout_ms, ret_reply);
}

static int fetch_status(ctl_t *ctl, Fsdp__V1__StatusReply **ret_reply) {
  Fsdp__V1__StatusRequest request = FSDP__V1__STATUS_REQUEST__INIT;
  ProtobufCMessage *reply = NULL;
  int r = operator_call(ctl, "Status", &request.base, &fsdp__v1__status_reply__descriptor, &reply);
  if (r < 0)
    return r;
  *ret_reply = (Fsdp__V1__StatusReply *)reply;
  return 0;
}

/* Printing helpers. */

static const char *state_name(Fsdp__V1__ServingState state) {
  switch (state) {
  case FSDP__V1__SERVING_STATE__SERVING_STATE_SERVING:
    return "SERVING";
  case FSDP__V1__SERVING_STATE__SERVING_STATE_DRAINING:
    return "DRAINING";
  case FSDP__V1__SERVING_STATE__SERVING_STATE_STOPPING:
    return "STOPPING";
  default:
    return "UNSPECIFIED";
  }
}

static const char *source_name(Fsdp__V1__ConfigSource source) {
  switch (source) {
  case FSDP__V1__CONFIG_SOURCE__CONFIG_SOURCE_DEFAULT:
    return "default";
  case FSDP__V1__CONFIG_SOURCE__CONFIG_SOURCE_FILE:
    return "file";
  case FSDP__V1__CONFIG_SOURCE__CONFIG_SOURCE_ENV:
    return "env";
  case FSDP__V1__CONFIG_SOURCE__CONFIG_SOURCE_FLAG:
    return "flag";
  default:
    return "unspecified";
  }
}

/* "1.5 GiB", "512 B". */
static void format_bytes(uint64_t bytes, char *buf, size_t size) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = (double)bytes;
  size_t u = 0;
  while (v >= 1024 && u + 1 < sizeof units / sizeof units[0]) {
    v /= 1024;
    u++;
  }
  if (u == 0)
    snprintf(buf, size, "%" PRIu64 " B", bytes);
  else
    snprintf(buf, size, "%.1f %s", v, units[u]);
}

/* "2d 3h 4m 5s", "4m 5s", "1.234s". */
static void format_duration(uint64_t ms, char *buf, size_t size) {
  uint64_t s = ms / 1000, d = s / 86400, h = s / 3600 % 24, m = s / 60 % 60;
  if (d)
    snprintf(buf, size, "%" PRIu64 "d %" PRIu64 "h %" PRIu64 "m %" PRIu64 "s", d, h, m, s % 60);
  else if (h)
    snprintf(buf, size, "%" PRIu64 "h %" PRIu64 "m %" PRIu64 "s", h, m, s % 60);
  else if (m)
    snprintf(buf, size, "%" PRIu64 "m %" PRIu64 "s", m, s % 60);
  else
    snprintf(buf, size, "%" PRIu64 ".%03" PRIu64 "s", s, ms % 1000);
}

/* "file /etc/fsdpd/fsdpd.conf:12", "env FSDPD_LOG_LEVEL", "default". */
static void format_source(const Fsdp__V1__ConfigEntry *e, char *buf, size_t size) {
  if (e->origin && *e->origin)
    snprintf(buf, size, "%s %s", source_name(e->source), e->origin);
  else
    snprintf(buf, size, "%s", source_name(e->source));
}

static int max_int(int a, int b) {
  return a > b ? a : b;
}

static int text_width(const char *s, int cap) {
  int n = (int)strlen(s);
  return n > cap ? cap : n;
}

/* Prints one JSON object and frees it. Slashes stay unescaped: paths are common here. */
static void print_json(json_object *obj) {
  puts(json_object_to_json_string_ext(obj, JSON_C_TO_STRING_PRETTY | JSON_C_TO_STRING_SPACED |
                                               JSON_C_TO_STRING_NOSLASHESCAPE));
  json_object_put(obj);
}

static json_object *json_string(const char *s) {
  return json_object_new_string(s ? s : "");
}

static json_object *config_entry_json(const Fsdp__V1__ConfigEntry *e) {
  json_object *o = json_object_new_object();
  json_object_object_add(o, "key", json_string(e->key));
  json_object_object_add(o, "value", json_string(e->value));
  json_object_object_add(o, "default_value", json_string(e->default_value));
  json_object_object_add(o, "source", json_string(source_name(e->source)));
  json_object_object_add(o, "origin", json_string(e->origin));
  json_object_object_add(o, "reloadable", json_object_new_boolean(e->reloadable));
  json_object_object_add(o, "unit", json_string(e->unit));
  json_object_object_add(o, "help", json_string(e->help));
  return o;
}

static json_object *config_json(const Fsdp__V1__StatusReply *s) {
  json_object *a = json_object_new_array();
  for (size_t i = 0; i < s->n_config; i++)
    json_object_array_add(a, config_entry_json(s->config[i]));
  return a;
}

/* Incarnations are 64-bit random ids; JSON numbers lose bits past 2^53, so they are strings
 * of 16 hex digits, as the daemon's log writes them. */
static const char *hex64(uint64_t v) {
  static char buf[4][20];
  static unsigned next;
  char *b = buf[next++ % 4];
  snprintf(b, sizeof buf[0], "%016" PRIx64, v);
  return b;
}

static json_object *pool_json(const Fsdp__V1__Pool *p) {
  json_object *o = json_object_new_object();
  json_object_object_add(o, "buffers", json_object_new_int64(p ? p->buffers : 0));
  json_object_object_add(o, "bytes", json_object_new_uint64(p ? p->bytes : 0));
  json_object_object_add(o, "lent", json_object_new_int64(p ? p->lent : 0));
  json_object_object_add(o, "most_lent", json_object_new_int64(p ? p->most_lent : 0));
  json_object_object_add(o, "waits", json_object_new_uint64(p ? p->waits : 0));
  return o;
}

static json_object *peers_json(const Fsdp__V1__StatusReply *s) {
  json_object *a = json_object_new_array();
  for (size_t i = 0; i < s->n_peers; i++) {
    const Fsdp__V1__PeerStatus *p = s->peers[i];
    json_object *po = json_object_new_object();
    json_object_object_add(po, "host_rank", json_object_new_int64(p->host_rank));
    json_object_object_add(po, "address", json_string(p->address));
    json_object_object_add(po, "state", json_string(fsdp_wire_peer_state_name(p->state)));
    json_object_object_add(po, "last_heard_ms", json_object_new_int64(p->last_heard_ms));
    json_object_object_add(po, "rtt_us", json_object_new_uint64(p->rtt_us));
    json_object_object_add(po, "incarnation", json_string(p->incarnation ? hex64(p->incarnation) : ""));
    json_object_object_add(po, "last_error", json_string(p->last_error));
    json_object_object_add(po, "ucx_address_bytes", json_object_new_int64(p->ucx_address_bytes));
    json_object_array_add(a, po);
  }
  return a;
}

/* "2 of 3 peers joined, ready" for status. */
static void peers_summary(const Fsdp__V1__StatusReply *s, char *buf, size_t size) {
  unsigned joined = 0, others = 0;
  for (size_t i = 0; i < s->n_peers; i++) {
    if (s->peers[i]->state == FSDP__V1__PEER_STATE__PEER_STATE_SELF)
      continue;
    others++;
    joined += s->peers[i]->state == FSDP__V1__PEER_STATE__PEER_STATE_JOINED;
  }
  if (others == 0) {
    snprintf(buf, size, "none (one host)");
    return;
  }
  int used = snprintf(buf, size, "%u of %u joined, %s", joined, others,
                      s->topology && s->topology->peers_ready ? "ready" : "not ready");
  for (size_t i = 0; i < s->n_peers && used > 0 && (size_t)used < size; i++) {
    const Fsdp__V1__PeerStatus *p = s->peers[i];
    if (p->state == FSDP__V1__PEER_STATE__PEER_STATE_SELF ||
        p->state == FSDP__V1__PEER_STATE__PEER_STATE_JOINED)
      continue;
    used += snprintf(buf + used, size - (size_t)used, "; host %" PRIu32 " %s", p->host_rank,
                     fsdp_wire_peer_state_name(p->state));
  }
}

/* Field names are those of operator.proto; enums are spelled without their prefix. */
static json_object *status_json(const ctl_t *ctl, const Fsdp__V1__StatusReply *s) {
  json_object *o = json_object_new_object();
  json_object_object_add(o, "target", json_string(ctl->target));
  json_object_object_add(o, "version", json_string(s->version));
  json_object_object_add(o, "protocol_version", json_object_new_int64(s->protocol_version));
  json_object_object_add(o, "pid", json_object_new_int(s->pid));
  json_object_object_add(o, "uptime_ms", json_object_new_uint64(s->uptime_ms));
  json_object_object_add(o, "state", json_string(state_name(s->state)));
  json_object_object_add(o, "config_file", json_string(s->config_file));
  json_object_object_add(o, "backend", json_string(s->backend));

  json_object *topo = json_object_new_object();
  json_object_object_add(topo, "host_rank",
                         json_object_new_int64(s->topology ? s->topology->host_rank : 0));
  json_object_object_add(topo, "hosts", json_object_new_int64(s->topology ? s->topology->hosts : 0));
  if (s->topology) {
    json_object_object_add(topo, "local_world_size",
                           json_object_new_int64(s->topology->local_world_size));
    json_object_object_add(topo, "shard_group_hosts",
                           json_object_new_int64(s->topology->shard_group_hosts));
    json_object_object_add(topo, "peers_ready", json_object_new_boolean(s->topology->peers_ready));
    json_object_object_add(topo, "incarnation", json_string(hex64(s->topology->incarnation)));
  }
  json_object_object_add(o, "topology", topo);
  json_object_object_add(o, "peers", peers_json(s));

  json_object *mem = json_object_new_object();
  json_object_object_add(mem, "in_use_bytes",
                         json_object_new_uint64(s->memory ? s->memory->in_use_bytes : 0));
  json_object_object_add(mem, "limit_bytes",
                         json_object_new_uint64(s->memory ? s->memory->limit_bytes : 0));
  json_object_object_add(mem, "reserved_bytes",
                         json_object_new_uint64(s->memory ? s->memory->reserved_bytes : 0));
  json_object *jobs = json_object_new_array();
  for (size_t i = 0; i < s->n_jobs; i++) {
    json_object *jo = json_object_new_object();
    json_object_object_add(jo, "job", json_string(s->jobs[i]->job));
    json_object_object_add(jo, "arena_bytes", json_object_new_uint64(s->jobs[i]->arena_bytes));
    json_object_object_add(jo, "used_bytes", json_object_new_uint64(s->jobs[i]->used_bytes));
    json_object_object_add(jo, "units", json_object_new_int64(s->jobs[i]->units));
    json_object_object_add(jo, "local_world_size",
                           json_object_new_int64(s->jobs[i]->local_world_size));
    json_object_object_add(jo, "max_inflight", json_object_new_int64(s->jobs[i]->max_inflight));
    json_object_object_add(jo, "forward_prefetch",
                           json_object_new_int64(s->jobs[i]->forward_prefetch));
    json_object_object_add(jo, "backward_prefetch",
                           json_object_new_int64(s->jobs[i]->backward_prefetch));
    json_object_object_add(jo, "order_given", json_object_new_boolean(s->jobs[i]->order_given));
    json_object_object_add(jo, "copies", pool_json(s->jobs[i]->copies));
    json_object_object_add(jo, "sums", pool_json(s->jobs[i]->sums));
    json_object_object_add(jo, "optimizer", json_string(s->jobs[i]->optimizer));
    json_object_object_add(jo, "optimizer_bytes",
                           json_object_new_uint64(s->jobs[i]->optimizer_bytes));
    json_object_object_add(jo, "checkpoint_staging_bytes",
                           json_object_new_uint64(s->jobs[i]->checkpoint_staging_bytes));
    json_object_object_add(jo, "ring_staging_buffers",
                           json_object_new_int64(s->jobs[i]->ring_staging_buffers));
    json_object_object_add(jo, "ring_staging_bytes",
                           json_object_new_uint64(s->jobs[i]->ring_staging_bytes));
    json_object_object_add(jo, "last_checkpoint_step",
                           json_object_new_uint64(s->jobs[i]->last_checkpoint_step));
    json_object_object_add(jo, "last_checkpoint_path",
                           json_string(s->jobs[i]->last_checkpoint_path));
    json_object_object_add(jo, "checkpoint_state", json_string(s->jobs[i]->checkpoint_state));
    json_object *gradients = json_object_new_array();
    for (size_t r = 0; r < s->jobs[i]->n_gradients; r++)
      json_object_array_add(gradients, pool_json(s->jobs[i]->gradients[r]));
    json_object_object_add(jo, "gradients", gradients);
    json_object_array_add(jobs, jo);
  }
  json_object_object_add(mem, "jobs", jobs);
  json_object_object_add(o, "memory", mem);

  json_object *listeners = json_object_new_array();
  for (size_t i = 0; i < s->n_listeners; i++) {
    const Fsdp__V1__Listener *l = s->listeners[i];
    json_object *lo = json_object_new_object();
    json_object_object_add(lo, "address", json_string(l->address));
    json_object *services = json_object_new_array();
    for (size_t k = 0; k < l->n_services; k++)
      json_object_array_add(services, json_string(l->services[k]));
    json_object_object_add(lo, "services", services);
    json_object_array_add(listeners, lo);
  }
  json_object_object_add(o, "listeners", listeners);

  json_object *sessions = json_object_new_array();
  for (size_t i = 0; i < s->n_sessions; i++) {
    const Fsdp__V1__Session *se = s->sessions[i];
    json_object *so = json_object_new_object();
    json_object_object_add(so, "session_id", json_object_new_uint64(se->session_id));
    json_object_object_add(so, "job", json_string(se->job));
    json_object_object_add(so, "local_rank", json_object_new_int64(se->local_rank));
    json_object_object_add(so, "pid", json_object_new_int(se->pid));
    json_object_object_add(so, "uid", json_object_new_int64(se->uid));
    json_object_object_add(so, "local_world_size", json_object_new_int64(se->local_world_size));
    json_object_object_add(so, "generation", json_object_new_uint64(se->generation));
    json_object_object_add(so, "attached_ms", json_object_new_uint64(se->attached_ms));
    json_object_object_add(so, "idle_ms", json_object_new_uint64(se->idle_ms));
    json_object_array_add(sessions, so);
  }
  json_object_object_add(o, "sessions", sessions);

  json_object_object_add(o, "rpc_calls_total", json_object_new_uint64(s->rpc_calls_total));
  json_object_object_add(o, "rpc_calls_failed", json_object_new_uint64(s->rpc_calls_failed));
  json_object_object_add(o, "rpc_calls_inflight", json_object_new_int64(s->rpc_calls_inflight));
  json_object_object_add(o, "rpc_work_inflight", json_object_new_int64(s->rpc_work_inflight));
  json_object_object_add(o, "config", config_json(s));
  return o;
}

#define LABEL "%-13s"

/* "  in flight, at most 2: copies 1 lent (most 2; 2 made, 1.5 MiB; 3 waits), ..." with the
 * local ranks' gradient pools summed (their "most" is the largest rank's), and the host
 * sums of a job across hosts. */
static void print_pools(const Fsdp__V1__JobMemory *j) {
  Fsdp__V1__Pool grads = FSDP__V1__POOL__INIT;
  for (size_t r = 0; r < j->n_gradients; r++) {
    const Fsdp__V1__Pool *p = j->gradients[r];
    grads.buffers += p->buffers;
    grads.bytes += p->bytes;
    grads.lent += p->lent;
    grads.most_lent = p->most_lent > grads.most_lent ? p->most_lent : grads.most_lent;
    grads.waits += p->waits;
  }
  static const Fsdp__V1__Pool none = FSDP__V1__POOL__INIT;
  const Fsdp__V1__Pool *pools[3] = {j->copies ? j->copies : &none, &grads,
                                    j->sums ? j->sums : &none};
  const char *names[3] = {"copies", "gradients", "host sums"};
  printf(LABEL "  in flight, at most %" PRIu32 ":", "", j->max_inflight);
  for (size_t k = 0; k < 3; k++) {
    if (k == 2 && !pools[k]->buffers)
      continue; /* a job on one host has none */
    char bytes[32];
    format_bytes(pools[k]->bytes, bytes, sizeof bytes);
    printf("%s %s %" PRIu32 " lent (most %" PRIu32 "%s; %" PRIu32 " made, %s; %" PRIu64
           " waits)",
           k ? "," : "", names[k], pools[k]->lent, pools[k]->most_lent,
           k == 1 ? " per rank" : "", pools[k]->buffers, bytes, pools[k]->waits);
  }
  printf("\n");
  printf(LABEL "  prefetch %" PRIu32 " ahead in forward, %" PRIu32 " in backward; forward order %s\n",
         "", j->forward_prefetch, j->backward_prefetch,
         j->order_given ? "given" : "recorded from the steps");
  if (j->optimizer && *j->optimizer) {
    char bytes[32];
    format_bytes(j->optimizer_bytes, bytes, sizeof bytes);
    printf(LABEL "  optimizer %s in the daemon, state %s\n", "", j->optimizer, bytes);
  }
  if (j->ring_staging_buffers) {
    char bytes[32];
    format_bytes(j->ring_staging_bytes, bytes, sizeof bytes);
    printf(LABEL "  rings among hosts staged in %" PRIu32 " host buffer%s, %s\n", "",
           j->ring_staging_buffers, j->ring_staging_buffers == 1 ? "" : "s", bytes);
  }
  if ((j->last_checkpoint_path && *j->last_checkpoint_path) ||
      (j->checkpoint_state && *j->checkpoint_state)) {
    char bytes[32];
    format_bytes(j->checkpoint_staging_bytes, bytes, sizeof bytes);
    printf(LABEL "  checkpoint: ", "");
    if (j->last_checkpoint_path && *j->last_checkpoint_path)
      printf("last step %" PRIu64 " in %s", j->last_checkpoint_step, j->last_checkpoint_path);
    else
      printf("none saved yet");
    printf("%s%s; staging %s\n", j->checkpoint_state && *j->checkpoint_state ? "; now " : "",
           j->checkpoint_state ? j->checkpoint_state : "", bytes);
  }
}

static void print_status(const ctl_t *ctl, const Fsdp__V1__StatusReply *s) {
  char a[64], b[64], a2[512];
  printf(LABEL "%s (protocol %" PRIu32 ")\n", "fsdpd", s->version, s->protocol_version);
  printf(LABEL "%s\n", "target", ctl->target);
  printf(LABEL "%" PRId32 "\n", "pid", s->pid);
  format_duration(s->uptime_ms, a, sizeof a);
  printf(LABEL "%s\n", "uptime", a);
  printf(LABEL "%s\n", "state", state_name(s->state));
  printf(LABEL "%s\n", "config file",
         s->config_file && *s->config_file ? s->config_file : "(none: built-in defaults)");
  printf(LABEL "%s\n", "backend", s->backend && *s->backend ? s->backend : "-");
  if (s->topology)
    printf(LABEL "host %" PRIu32 " of %" PRIu32 "\n", "topology", s->topology->host_rank,
           s->topology->hosts);
  else
    printf(LABEL "-\n", "topology");
  peers_summary(s, a2, sizeof a2);
  printf(LABEL "%s\n", "peers", a2);
  if (s->memory) {
    char r[32];
    format_bytes(s->memory->in_use_bytes, a, sizeof a);
    format_bytes(s->memory->reserved_bytes, r, sizeof r);
    if (s->memory->limit_bytes) {
      format_bytes(s->memory->limit_bytes, b, sizeof b);
      printf(LABEL "%s reserved of %s limit (%.0f%%), %s in use\n", "memory", r, b,
             100.0 * (double)s->memory->reserved_bytes / (double)s->memory->limit_bytes, a);
    } else {
      printf(LABEL "%s reserved, %s in use, no limit\n", "memory", r, a);
    }
  } else {
    printf(LABEL "-\n", "memory");
  }
  for (size_t i = 0; i < s->n_jobs; i++) {
    const Fsdp__V1__JobMemory *j = s->jobs[i];
    format_bytes(j->used_bytes, a, sizeof a);
    format_bytes(j->arena_bytes, b, sizeof b);
    printf(LABEL "job %s: %s of its %s arena, %" PRIu32 " unit%s, %" PRIu32 " local ranks\n", "",
           j->job, a, b, j->units, j->units == 1 ? "" : "s", j->local_world_size);
    print_pools(j);
  }
  printf(LABEL "%" PRIu64 " total, %" PRIu64 " failed, %" PRIu32 " in flight (%" PRIu32
         " work)\n",
         "rpc calls", s->rpc_calls_total, s->rpc_calls_failed, s->rpc_calls_inflight,
         s->rpc_work_inflight);

  int aw = 0;
  for (size_t i = 0; i < s->n_listeners; i++)
    aw = max_int(aw, text_width(s->listeners[i]->address, 60));
  for (size_t i = 0; i < s->n_listeners; i++) {
    const Fsdp__V1__Listener *l = s->listeners[i];
    printf(LABEL "%-*s ", i == 0 ? "listeners" : "", aw, l->address);
    for (size_t k = 0; k < l->n_services; k++)
      printf("%s%s", k ? ", " : " ", l->services[k]);
    putchar('\n');
  }
  if (s->n_listeners == 0)
    printf(LABEL "none\n", "listeners");

  if (s->n_sessions == 0) {
    printf(LABEL "none\n", "sessions");
    return;
  }
  printf(LABEL "%zu\n", "sessions", s->n_sessions);
  int jw = 3;
  for (size_t i = 0; i < s->n_sessions; i++)
    jw = max_int(jw, text_width(s->sessions[i]->job, 40));
  /* Ids in hex, as the daemon's log writes them. */
  printf("  %-16s %-*s %7s %4s %8s %6s  %-10s %s\n", "ID", jw, "JOB", "RANK", "GEN", "PID", "UID",
         "ATTACHED", "IDLE");
  for (size_t i = 0; i < s->n_sessions; i++) {
    const Fsdp__V1__Session *se = s->sessions[i];
    char rank[24], idle[32];
    snprintf(rank, sizeof rank, "%" PRIu32 "/%" PRIu32, se->local_rank, se->local_world_size);
    format_duration(se->attached_ms, a, sizeof a);
    format_duration(se->idle_ms, idle, sizeof idle);
    printf("  %016" PRIx64 " %-*s %7s %4" PRIu64 " %8" PRId32 " %6" PRIu32 "  %-10s %s\n",
           se->session_id, jw, se->job, rank, se->generation, se->pid, se->uid, a, idle);
  }
}

/* Commands. */

static int cmd_status(ctl_t *ctl, int argc, char **argv) {
  (void)argc, (void)argv;
  Fsdp__V1__StatusReply *s = NULL;
  int r = fetch_status(ctl, &s);
  if (r < 0)
    return rpc_error(ctl, "Operator.Status", r);
  if (ctl->json)
    print_json(status_json(ctl, s));
  else
    print_status(ctl, s);
  int rc = s->state == FSDP__V1__SERVING_STATE__SERVING_STATE_SERVING ? EXIT_OK : EXIT_NOT_SERVING;
  protobuf_c_message_free_unpacked(&s->base, NULL);
  return rc;
}

static void print_peers(const Fsdp__V1__StatusReply *s) {
  const Fsdp__V1__Topology *t = s->topology;
  if (s->n_peers == 0) {
    printf("one host: no peers (cluster.hosts is empty)\n");
    return;
  }
  printf("host %" PRIu32 " of %" PRIu32 ", incarnation %s, local world size %" PRIu32
         ", cluster %s\n",
         t ? t->host_rank : 0, t ? t->hosts : 0, hex64(t ? t->incarnation : 0),
         t ? t->local_world_size : 0, t && t->peers_ready ? "ready" : "not ready");
  int aw = 7;
  for (size_t i = 0; i < s->n_peers; i++)
    aw = max_int(aw, text_width(s->peers[i]->address, 60));
  printf("%-4s %-*s %-8s %8s %9s %-16s %s\n", "HOST", aw, "ADDRESS", "STATE", "HEARD", "RTT",
         "INCARNATION", "LAST ERROR");
  for (size_t i = 0; i < s->n_peers; i++) {
    const Fsdp__V1__PeerStatus *p = s->peers[i];
    char heard[32], rtt[32];
    if (p->state == FSDP__V1__PEER_STATE__PEER_STATE_SELF || p->last_heard_ms < 0)
      snprintf(heard, sizeof heard, "-");
    else
      format_duration((uint64_t)p->last_heard_ms, heard, sizeof heard);
    if (p->rtt_us == 0)
      snprintf(rtt, sizeof rtt, "-");
    else if (p->rtt_us < 10000)
      snprintf(rtt, sizeof rtt, "%" PRIu64 "us", p->rtt_us);
    else
      snprintf(rtt, sizeof rtt, "%" PRIu64 "ms", p->rtt_us / 1000);
    printf("%-4" PRIu32 " %-*s %-8s %8s %9s %-16s %s\n", p->host_rank, aw, p->address,
           fsdp_wire_peer_state_name(p->state), heard, rtt, p->incarnation ? hex64(p->incarnation) : "-",
           p->last_error[0] ? p->last_error : "-");
  }
}

/* Exit 0 when every peer is joined (or there are none), 3 when the cluster is not ready. */
static int cmd_peers(ctl_t *ctl, int argc, char **argv) {
  (void)argc, (void)argv;
  Fsdp__V1__StatusReply *s = NULL;
  int r = fetch_status(ctl, &s);
  if (r < 0)
    return rpc_error(ctl, "Operator.Status", r);
  bool ready = !s->topology || s->topology->peers_ready;
  if (ctl->json) {
    json_object *o = json_object_new_object();
    json_object_object_add(o, "target", json_string(ctl->target));
    json_object_object_add(o, "host_rank",
                           json_object_new_int64(s->topology ? s->topology->host_rank : 0));
    json_object_object_add(o, "hosts", json_object_new_int64(s->topology ? s->topology->hosts : 1));
    json_object_object_add(o, "incarnation",
                           json_string(hex64(s->topology ? s->topology->incarnation : 0)));
    json_object_object_add(o, "ready", json_object_new_boolean(ready));
    json_object_object_add(o, "peers", peers_json(s));
    print_json(o);
  } else {
    print_peers(s);
  }
  protobuf_c_message_free_unpacked(&s->base, NULL);
  return ready ? EXIT_OK : EXIT_NOT_SERVING;
}

static int cmd_health(ctl_t *ctl, int argc, char **argv) {
  const char *service = argc > 0 ? argv[0] : "";
  fsdp_health_status_t hs;
  int r = fsdp_client_health_check(ctl->client, service, ctl->timeout_ms, &hs);
  if (r < 0)
    return rpc_error(ctl, "Health.Check", r);
  if (ctl->json) {
    json_object *o = json_object_new_object();
    json_object_object_add(o, "target", json_string(ctl->target));
    json_object_object_add(o, "service", json_string(service));
    json_object_object_add(o, "status", json_string(fsdp_health_status_name(hs)));
    print_json(o);
  } else if (*service) {
    printf("%s: %s\n", service, fsdp_health_status_name(hs));
  } else {
    printf("%s\n", fsdp_health_status_name(hs));
  }
  return hs == FSDP_HEALTH_SERVING ? EXIT_OK : EXIT_NOT_SERVING;
}

static void print_config_table(const Fsdp__V1__StatusReply *s) {
  char src[256];
  int kw = 3, vw = 5, sw = 6;
  for (size_t i = 0; i < s->n_config; i++) {
    const Fsdp__V1__ConfigEntry *e = s->config[i];
    format_source(e, src, sizeof src);
    kw = max_int(kw, text_width(e->key, 40));
    vw = max_int(vw, text_width(e->value, 40));
    sw = max_int(sw, text_width(src, 50));
  }
  printf("%-*s  %-*s  %-*s  %s\n", kw, "KEY", vw, "VALUE", sw, "SOURCE", "RELOADABLE");
  for (size_t i = 0; i < s->n_config; i++) {
    const Fsdp__V1__ConfigEntry *e = s->config[i];
    format_source(e, src, sizeof src);
    printf("%-*s  %-*s  %-*s  %s\n", kw, e->key, vw, e->value, sw, src,
           e->reloadable ? "yes" : "no");
  }
}

static void print_config_verbose(const Fsdp__V1__StatusReply *s) {
  char src[256];
  for (size_t i = 0; i < s->n_config; i++) {
    const Fsdp__V1__ConfigEntry *e = s->config[i];
    format_source(e, src, sizeof src);
    printf("%s%s = %s\n", i ? "\n" : "", e->key, e->value);
    printf("    source      %s\n", src);
    printf("    default     %s\n", e->default_value);
    if (e->unit && *e->unit)
      printf("    unit        %s\n", e->unit);
    printf("    reloadable  %s\n", e->reloadable ? "yes (config reload / SIGHUP)" : "no (restart)");
    if (e->help && *e->help)
      printf("    help        %s\n", e->help);
  }
}

static int cmd_config_show(ctl_t *ctl, int argc, char **argv) {
  (void)argc, (void)argv;
  Fsdp__V1__StatusReply *s = NULL;
  int r = fetch_status(ctl, &s);
  if (r < 0)
    return rpc_error(ctl, "Operator.Status", r);
  if (ctl->json) {
    json_object *o = json_object_new_object();
    json_object_object_add(o, "config_file", json_string(s->config_file));
    json_object_object_add(o, "config", config_json(s));
    print_json(o);
  } else {
    printf("# config file: %s\n",
           s->config_file && *s->config_file ? s->config_file : "(none: built-in defaults)");
    if (ctl->verbose)
      print_config_verbose(s);
    else
      print_config_table(s);
  }
  protobuf_c_message_free_unpacked(&s->base, NULL);
  return EXIT_OK;
}

static int cmd_config_reload(ctl_t *ctl, int argc, char **argv) {
  (void)argc, (void)argv;
  Fsdp__V1__ReloadConfigRequest request = FSDP__V1__RELOAD_CONFIG_REQUEST__INIT;
  ProtobufCMessage *reply = NULL;
  int r = operator_call(ctl, "ReloadConfig", &request.base,
                        &fsdp__v1__reload_config_reply__descriptor, &reply);
  if (r < 0)
    return rpc_error(ctl, "Operator.ReloadConfig", r);
  const Fsdp__V1__ReloadConfigReply *rr = (const Fsdp__V1__ReloadConfigReply *)reply;
  if (ctl->json) {
    json_object *o = json_object_new_object();
    json_object *changed = json_object_new_array();
    for (size_t i = 0; i < rr->n_changed; i++)
      json_object_array_add(changed, json_string(rr->changed[i]));
    json_object_object_add(o, "changed", changed);
    print_json(o);
  } else if (rr->n_changed == 0) {
    printf("config reloaded, nothing changed\n");
  } else {
    printf("config reloaded, %zu changed:\n", rr->n_changed);
    for (size_t i = 0; i < rr->n_changed; i++)
      printf("  %s\n", rr->changed[i]);
  }
  protobuf_c_message_free_unpacked(reply, NULL);
  return EXIT_OK;
}

static int cmd_drain(ctl_t *ctl, int argc, char **argv) {
  (void)argc, (void)argv;
  Fsdp__V1__DrainRequest request = FSDP__V1__DRAIN_REQUEST__INIT;
  ProtobufCMessage *reply = NULL;
  int r = operator_call(ctl, "Drain", &request.base, &fsdp__v1__drain_reply__descriptor, &reply);
  if (r < 0)
    return rpc_error(ctl, "Operator.Drain", r);
  const Fsdp__V1__DrainReply *dr = (const Fsdp__V1__DrainReply *)reply;
  if (ctl->json) {
    json_object *o = json_object_new_object();
    json_object_object_add(o, "work_inflight", json_object_new_int64(dr->work_inflight));
    print_json(o);
  } else {
    printf("draining: new work is refused, %" PRIu32 " call%s still in flight\n",
           dr->work_inflight, dr->work_inflight == 1 ? "" : "s");
  }
  protobuf_c_message_free_unpacked(reply, NULL);
  return EXIT_OK;
}

static int cmd_resume(ctl_t *ctl, int argc, char **argv) {
  (void)argc, (void)argv;
  Fsdp__V1__ResumeRequest request = FSDP__V1__RESUME_REQUEST__INIT;
  ProtobufCMessage *reply = NULL;
  int r = operator_call(ctl, "Resume", &request.base, &fsdp__v1__resume_reply__descriptor, &reply);
  if (r < 0)
    return rpc_error(ctl, "Operator.Resume", r);
  if (ctl->json)
    print_json(json_object_new_object());
  else
    printf("serving\n");
  protobuf_c_message_free_unpacked(reply, NULL);
  return EXIT_OK;
}

static const char *enum_text(const ProtobufCEnumDescriptor *desc, int value) {
  const ProtobufCEnumValue *v = protobuf_c_enum_descriptor_get_value(desc, value);
  return v ? v->name : "?";
}

/* "fp32" from DTYPE_FP32. */
static const char *dtype_text(Fsdp__V1__DType dtype) {
  switch (dtype) {
  case FSDP__V1__DTYPE__DTYPE_FP32:
    return "fp32";
  case FSDP__V1__DTYPE__DTYPE_BF16:
    return "bf16";
  case FSDP__V1__DTYPE__DTYPE_FP16:
    return "fp16";
  default:
    return "?";
  }
}

static json_object *ranks_json(const uint32_t *ranks, size_t n) {
  json_object *a = json_object_new_array();
  for (size_t r = 0; r < n; r++)
    json_object_array_add(a, json_object_new_int64(ranks[r]));
  return a;
}

/* Where a unit's unsharded copy is: "none", "masters", "pool", "own". */
static const char *copy_text(Fsdp__V1__UnitInfo__Copy copy) {
  switch (copy) {
  case FSDP__V1__UNIT_INFO__COPY__COPY_MASTERS:
    return "masters";
  case FSDP__V1__UNIT_INFO__COPY__COPY_POOL:
    return "pool";
  case FSDP__V1__UNIT_INFO__COPY__COPY_OWN:
    return "own";
  default:
    return "none";
  }
}

/* " 0, 2" after label, or nothing when no rank. */
static void print_ranks(const char *label, const uint32_t *ranks, size_t n) {
  if (!n)
    return;
  printf("%s", label);
  for (size_t r = 0; r < n; r++)
    printf("%s%" PRIu32, r ? ", " : " ", ranks[r]);
}

static json_object *unit_info_json(const Fsdp__V1__UnitInfo *u) {
  json_object *o = json_object_new_object();
  json_object_object_add(o, "job", json_string(u->job));
  json_object_object_add(o, "unit", json_string(u->unit));
  json_object_object_add(o, "strategy",
                         json_string(enum_text(&fsdp__v1__sharding_strategy__descriptor, u->strategy)));
  json_object_object_add(o, "layout",
                         json_string(enum_text(&fsdp__v1__unit_layout__descriptor, u->layout)));
  json_object_object_add(o, "dtype", json_string(dtype_text(u->dtype)));
  json_object_object_add(o, "param_dtype", json_string(dtype_text(u->param_dtype)));
  json_object_object_add(o, "reduce_dtype", json_string(dtype_text(u->reduce_dtype)));
  json_object_object_add(o, "numel", json_object_new_uint64(u->numel));
  json_object_object_add(o, "padded_numel", json_object_new_uint64(u->padded_numel));
  json_object_object_add(o, "shard_numel", json_object_new_uint64(u->shard_numel));
  json_object_object_add(o, "shards", json_object_new_int64(u->shards));
  json_object_object_add(o, "params", json_object_new_int64(u->params));
  json_object_object_add(o, "local_world_size", json_object_new_int64(u->local_world_size));
  json_object_object_add(o, "registered_ranks", json_object_new_int64(u->registered_ranks));
  json_object_object_add(o, "gathered_step", json_object_new_uint64(u->gathered_step));
  json_object_object_add(o, "reduced_step", json_object_new_uint64(u->reduced_step));
  json_object_object_add(o, "reshard_after_forward",
                         json_object_new_boolean(u->reshard_after_forward));
  json_object_object_add(o, "forward_index", json_object_new_int64(u->forward_index));
  json_object_object_add(o, "deferred_reduces", json_object_new_int64(u->deferred_reduces));
  json_object_object_add(o, "reduces", json_object_new_uint64(u->reduces));
  json_object_object_add(o, "replica_all_reduces",
                         json_object_new_uint64(u->replica_all_reduces));
  json_object_object_add(o, "optimizer_steps", json_object_new_uint64(u->optimizer_steps));
  json_object_object_add(o, "last_gather_us", json_object_new_uint64(u->last_gather_us));
  json_object_object_add(o, "last_reduce_us", json_object_new_uint64(u->last_reduce_us));
  json_object_object_add(o, "copy", json_string(copy_text(u->copy)));
  json_object_object_add(o, "copy_holders", ranks_json(u->copy_holders, u->n_copy_holders));
  json_object_object_add(o, "gradient_holders",
                         ranks_json(u->gradient_holders, u->n_gradient_holders));
  json_object *collectives = json_object_new_array();
  for (size_t i = 0; i < u->n_collectives; i++) {
    const Fsdp__V1__CollectiveInfo *c = u->collectives[i];
    json_object *co = json_object_new_object();
    json_object_object_add(
        co, "kind", json_string(enum_text(&fsdp__v1__collective_info__kind__descriptor, c->kind)));
    json_object_object_add(co, "step", json_object_new_uint64(c->step));
    json_object_object_add(co, "ranks", ranks_json(c->ranks, c->n_ranks));
    json_object_object_add(co, "running", json_object_new_boolean(c->running));
    json_object_object_add(co, "deadline_in_ms", json_object_new_int64(c->deadline_in_ms));
    json_object_array_add(collectives, co);
  }
  json_object_object_add(o, "collectives", collectives);
  return o;
}

/* "unshard of step 13: ranks 0, 2 of 4 asked, 29.5 s left" or "... running". */
static void print_collective(const Fsdp__V1__UnitInfo *u, const Fsdp__V1__CollectiveInfo *c) {
  printf("%s of step %" PRIu64 ": ",
         c->kind == FSDP__V1__COLLECTIVE_INFO__KIND__UNSHARD ? "unshard" : "reduce-scatter",
         c->step);
  if (c->running) {
    printf("every rank asked, running\n");
    return;
  }
  printf("rank%s ", c->n_ranks == 1 ? "" : "s");
  for (size_t r = 0; r < c->n_ranks; r++)
    printf("%s%" PRIu32, r ? ", " : "", c->ranks[r]);
  printf(" of %" PRIu32 " asked, %.1f s left\n", u->local_world_size,
         (double)c->deadline_in_ms / 1000.0);
}

static int cmd_units(ctl_t *ctl, int argc, char **argv) {
  (void)argc, (void)argv;
  Fsdp__V1__ListUnitsRequest request = FSDP__V1__LIST_UNITS_REQUEST__INIT;
  request.job = (char *)(ctl->job ? ctl->job : "");
  ProtobufCMessage *reply = NULL;
  int r = operator_call(ctl, "ListUnits", &request.base, &fsdp__v1__list_units_reply__descriptor,
                        &reply);
  if (r < 0)
    return rpc_error(ctl, "Operator.ListUnits", r);
  const Fsdp__V1__ListUnitsReply *lr = (const Fsdp__V1__ListUnitsReply *)reply;
  if (ctl->json) {
    json_object *units = json_object_new_array();
    for (size_t i = 0; i < lr->n_units; i++)
      json_object_array_add(units, unit_info_json(lr->units[i]));
    json_object *o = json_object_new_object();
    json_object_object_add(o, "units", units);
    print_json(o);
  } else if (lr->n_units == 0) {
    printf("no units%s%s\n", ctl->job ? " in job " : "", ctl->job ? ctl->job : "");
  } else {
    int jw = 3, uw = 4;
    for (size_t i = 0; i < lr->n_units; i++) {
      jw = max_int(jw, text_width(lr->units[i]->job, 32));
      uw = max_int(uw, text_width(lr->units[i]->unit, 40));
    }
    printf("%-*s  %-*s  %-13s %6s %14s %7s  %-14s %s\n", jw, "JOB", uw, "UNIT", "STRATEGY",
           "PARAMS", "ELEMENTS", "SHARDS", "DTYPES", "RANKS");
    for (size_t i = 0; i < lr->n_units; i++) {
      const Fsdp__V1__UnitInfo *u = lr->units[i];
      char dtypes[32], ranks[24];
      snprintf(dtypes, sizeof dtypes, "%s/%s/%s", dtype_text(u->dtype), dtype_text(u->param_dtype),
               dtype_text(u->reduce_dtype));
      snprintf(ranks, sizeof ranks, "%" PRIu32 "/%" PRIu32, u->registered_ranks, u->local_world_size);
      printf("%-*s  %-*s  %-13s %6" PRIu32 " %14" PRIu64 " %7" PRIu32 "  %-14s %s\n", jw, u->job,
             uw, u->unit, enum_text(&fsdp__v1__sharding_strategy__descriptor, u->strategy),
             u->params, u->numel, u->shards, dtypes, ranks);
    }
    printf("(DTYPES: parameters/unsharded/reduce; RANKS: registered/local world size)\n");
    bool header = false;
    for (size_t i = 0; i < lr->n_units; i++) {
      const Fsdp__V1__UnitInfo *u = lr->units[i];
      for (size_t c = 0; c < u->n_collectives; c++) {
        if (!header)
          printf("\ncollectives under way:\n");
        header = true;
        printf("  %s %s: ", u->job, u->unit);
        print_collective(u, u->collectives[c]);
      }
    }
  }
  protobuf_c_message_free_unpacked(reply, NULL);
  return EXIT_OK;
}

#define SHARD_MAP_WIDTH 48

/* One row of the shard map: across the whole flat buffer, the letter of the parameter at
 * each position inside this shard, '-' for padding, '.' for the rest of the buffer. */
static void draw_shard(const Fsdp__V1__DescribeUnitReply *d, const Fsdp__V1__ShardInfo *s,
                       char *row) {
  uint64_t padded = d->unit->padded_numel;
  for (int c = 0; c < SHARD_MAP_WIDTH; c++) {
    uint64_t e = (uint64_t)((2 * (unsigned __int128)c + 1) * padded / (2 * SHARD_MAP_WIDTH));
    char ch = '.';
    if (e >= s->begin && e < s->end) {
      ch = '-';
      for (size_t p = 0; p < d->n_params; p++)
        if (e >= d->params[p]->offset && e < d->params[p]->offset + d->params[p]->numel)
          ch = (char)('a' + p % 26);
    }
    row[c] = ch;
  }
  row[SHARD_MAP_WIDTH] = '\0';
}

static void print_shape(const Fsdp__V1__ParamInfo *p, char *buf, size_t size) {
  size_t used = (size_t)snprintf(buf, size, "[");
  for (size_t d = 0; d < p->n_shape && used < size; d++)
    used += (size_t)snprintf(buf + used, size - used, "%s%" PRIu64, d ? "," : "", p->shape[d]);
  if (used < size)
    snprintf(buf + used, size - used, "]");
}

static int cmd_unit(ctl_t *ctl, int argc, char **argv) {
  if (argc < 1)
    return usage_error("%s", "unit needs a NAME");
  Fsdp__V1__DescribeUnitRequest request = FSDP__V1__DESCRIBE_UNIT_REQUEST__INIT;
  request.job = (char *)(ctl->job ? ctl->job : "");
  request.unit = argv[0];
  ProtobufCMessage *reply = NULL;
  int r = operator_call(ctl, "DescribeUnit", &request.base,
                        &fsdp__v1__describe_unit_reply__descriptor, &reply);
  if (r < 0)
    return rpc_error(ctl, "Operator.DescribeUnit", r);
  const Fsdp__V1__DescribeUnitReply *d = (const Fsdp__V1__DescribeUnitReply *)reply;
  const Fsdp__V1__UnitInfo *u = d->unit;
  if (ctl->json) {
    json_object *o = unit_info_json(u);
    json_object *params = json_object_new_array(), *shards = json_object_new_array();
    for (size_t i = 0; i < d->n_params; i++) {
      json_object *p = json_object_new_object(), *shape = json_object_new_array();
      for (size_t k = 0; k < d->params[i]->n_shape; k++)
        json_object_array_add(shape, json_object_new_uint64(d->params[i]->shape[k]));
      json_object_object_add(p, "name", json_string(d->params[i]->name));
      json_object_object_add(p, "shape", shape);
      json_object_object_add(p, "offset", json_object_new_uint64(d->params[i]->offset));
      json_object_object_add(p, "numel", json_object_new_uint64(d->params[i]->numel));
      json_object_object_add(p, "requires_grad", json_object_new_boolean(d->params[i]->requires_grad));
      json_object_array_add(params, p);
    }
    for (size_t i = 0; i < d->n_shards; i++) {
      json_object *s = json_object_new_object();
      json_object_object_add(s, "shard", json_object_new_int64(d->shards[i]->shard));
      json_object_object_add(s, "host_rank", json_object_new_int64(d->shards[i]->host_rank));
      json_object_object_add(s, "local_rank", json_object_new_int64(d->shards[i]->local_rank));
      json_object_object_add(s, "begin", json_object_new_uint64(d->shards[i]->begin));
      json_object_object_add(s, "end", json_object_new_uint64(d->shards[i]->end));
      json_object_object_add(s, "padding", json_object_new_uint64(d->shards[i]->padding));
      json_object_array_add(shards, s);
    }
    json_object_object_add(o, "param_list", params);
    json_object_object_add(o, "shard_map", shards);
    print_json(o);
    protobuf_c_message_free_unpacked(reply, NULL);
    return EXIT_OK;
  }
  printf("unit %s (job %s): %s, %s, %" PRIu32 " parameter%s, %" PRIu64 " elements + %" PRIu64
         " padding = %" PRIu32 " shard%s of %" PRIu64 "\n",
         u->unit, u->job, enum_text(&fsdp__v1__sharding_strategy__descriptor, u->strategy),
         enum_text(&fsdp__v1__unit_layout__descriptor, u->layout),
         u->params, u->params == 1 ? "" : "s", u->numel, u->padded_numel - u->numel, u->shards,
         u->shards == 1 ? "" : "s", u->shard_numel);
  printf("%s parameters, unsharded %s, reduced in %s; %" PRIu32 " of %" PRIu32
         " local ranks registered\n",
         dtype_text(u->dtype), dtype_text(u->param_dtype), dtype_text(u->reduce_dtype),
         u->registered_ranks, u->local_world_size);
  printf("unsharded copy of step %" PRIu64 ", last reduce-scatter of step %" PRIu64 "%s\n",
         u->gathered_step, u->reduced_step, u->n_collectives ? "" : "; nothing under way");
  if (u->forward_index >= 0)
    printf("place %" PRId32 " in the forward order; ", u->forward_index);
  printf("%s after forward; copy: %s", u->reshard_after_forward ? "reshards" : "kept",
         copy_text(u->copy));
  print_ranks(", lent to ranks", u->copy_holders, u->n_copy_holders);
  print_ranks("; gradient buffers lent to ranks", u->gradient_holders, u->n_gradient_holders);
  printf("\n");
  if (u->optimizer_steps)
    printf("%" PRIu64 " optimizer steps taken by the daemon\n", u->optimizer_steps);
  if (u->last_gather_us || u->last_reduce_us)
    printf("the daemon's work of the last gather took %" PRIu64 " us, of the last reduce %" PRIu64
           " us\n",
           u->last_gather_us, u->last_reduce_us);
  if (u->replica_all_reduces || u->deferred_reduces)
    printf("%" PRIu64 " all-reduces among replicas; %" PRIu32
           " reduces deferred to the next\n",
           u->replica_all_reduces, u->deferred_reduces);
  for (size_t c = 0; c < u->n_collectives; c++) {
    printf("under way: ");
    print_collective(u, u->collectives[c]);
  }
  printf("\n");
  int nw = 4;
  for (size_t i = 0; i < d->n_params; i++)
    nw = max_int(nw, text_width(d->params[i]->name, 40));
  printf("    %-*s  %-18s %14s %14s\n", nw, "PARAM", "SHAPE", "OFFSET", "ELEMENTS");
  for (size_t i = 0; i < d->n_params; i++) {
    char shape[64];
    print_shape(d->params[i], shape, sizeof shape);
    printf("%c   %-*s  %-18s %14" PRIu64 " %14" PRIu64 "\n", (int)('a' + i % 26), nw,
           d->params[i]->name, shape, d->params[i]->offset, d->params[i]->numel);
  }
  bool replicated = u->strategy == FSDP__V1__SHARDING_STRATEGY__NO_SHARD;
  printf("\n%-5s  %-4s  %-5s  %-25s %8s  %s\n", "SHARD", "HOST", "RANK", "ELEMENTS", "PADDING",
         "FLAT BUFFER (letter: parameter, -: padding)");
  for (size_t i = 0; i < d->n_shards; i++) {
    const Fsdp__V1__ShardInfo *s = d->shards[i];
    char range[48], host[12], rank[12], row[SHARD_MAP_WIDTH + 1];
    snprintf(range, sizeof range, "[%" PRIu64 ", %" PRIu64 ")", s->begin, s->end);
    if (replicated) {
      snprintf(host, sizeof host, "all");
      snprintf(rank, sizeof rank, "all");
    } else {
      snprintf(host, sizeof host, "%" PRIu32, s->host_rank);
      snprintf(rank, sizeof rank, "%" PRIu32, s->local_rank);
    }
    draw_shard(d, s, row);
    printf("%-5" PRIu32 "  %-4s  %-5s  %-25s %8" PRIu64 "  |%s|\n", s->shard, host, rank, range,
           s->padding, row);
  }
  protobuf_c_message_free_unpacked(reply, NULL);
  return EXIT_OK;
}

/* checkpoint save|load JOB DIR: DIR as the daemon needs it, absolute (relative to here). */
static int checkpoint_call(ctl_t *ctl, const char *method, int argc, char **argv) {
  if (argc < 2)
    return usage_error("checkpoint %s needs a JOB and a DIR", strcmp(method, "SaveCheckpoint")
                                                                   ? "load"
                                                                   : "save");
  char cwd[PATH_MAX], path[2 * PATH_MAX];
  if (argv[1][0] == '/')
    snprintf(path, sizeof path, "%s", argv[1]);
  else if (getcwd(cwd, sizeof cwd))
    snprintf(path, sizeof path, "%s/%s", cwd, argv[1]);
  else
    return usage_error("cannot make '%s' absolute: %s", argv[1], strerror(errno));
  Fsdp__V1__CheckpointRequest request = FSDP__V1__CHECKPOINT_REQUEST__INIT;
  request.job = argv[0];
  request.path = path;
  ProtobufCMessage *reply = NULL;
  int r = operator_call(ctl, method, &request.base, &fsdp__v1__checkpoint_reply__descriptor,
                        &reply);
  char what[64];
  snprintf(what, sizeof what, "Operator.%s", method);
  if (r < 0)
    return rpc_error(ctl, what, r);
  const Fsdp__V1__CheckpointReply *c = (const Fsdp__V1__CheckpointReply *)reply;
  if (ctl->json) {
    json_object *o = json_object_new_object();
    json_object_object_add(o, "path", json_string(c->path));
    json_object_object_add(o, "step", json_object_new_uint64(c->step));
    print_json(o);
  } else {
    printf("job '%s': step %" PRIu64 " %s %s\n", argv[0], c->step,
           strcmp(method, "SaveCheckpoint") ? "loaded from" : "saved in", c->path);
  }
  protobuf_c_message_free_unpacked(reply, NULL);
  return EXIT_OK;
}

static int cmd_checkpoint_save(ctl_t *ctl, int argc, char **argv) {
  return checkpoint_call(ctl, "SaveCheckpoint", argc, argv);
}

static int cmd_checkpoint_load(ctl_t *ctl, int argc, char **argv) {
  return checkpoint_call(ctl, "LoadCheckpoint", argc, argv);
}

static int parse_dtype(const char *text, fsdp_dtype_t *ret) {
  static const char *const names[FSDP_DTYPE_COUNT] = {"fp32", "bf16", "fp16"};
  for (int t = 0; t < FSDP_DTYPE_COUNT; t++)
    if (strcmp(text, names[t]) == 0) {
      *ret = (fsdp_dtype_t)t;
      return 0;
    }
  return -EINVAL;
}

static int cmd_export(ctl_t *ctl, int argc, char **argv) {
  if (argc < 1 || !ctl->out)
    return usage_error("%s", "export needs a DIR and --out FILE");
  char dir[PATH_MAX];
  if ((size_t)snprintf(dir, sizeof dir, "%s%s%s", argv[0], ctl->step ? "/step-" : "",
                       ctl->step ? ctl->step : "") >= sizeof dir)
    return usage_error("export: DIR '%s' is too long", argv[0]);
  fsdp_status_t st;
  if (fsdp_export_safetensors(dir, ctl->out, ctl->dtype, &st) < 0) {
    fprintf(stderr, "fsdpctl: %s\n", st.message);
    return EXIT_ERROR;
  }
  if (ctl->json) {
    json_object *o = json_object_new_object();
    json_object_object_add(o, "out", json_string(ctl->out));
    print_json(o);
  } else {
    printf("exported %s\n", ctl->out);
  }
  return EXIT_OK;
}

/* trace's and record's: the records as --out's Chrome trace JSON, and what was written. */
static int write_trace(const ctl_t *ctl, const Fsdp__V1__TraceReply *t) {
  fsdp_status_t st;
  if (fsdpctl_write_trace(t, ctl->out, &st) < 0) {
    fprintf(stderr, "fsdpctl: %s\n", st.message);
    return EXIT_ERROR;
  }
  if (ctl->json) {
    json_object *o = json_object_new_object();
    json_object_object_add(o, "out", json_string(ctl->out));
    json_object_object_add(o, "records", json_object_new_uint64(t->n_records));
    json_object_object_add(o, "recorded", json_object_new_uint64(t->recorded));
    print_json(o);
  } else {
    printf("%zu operations of job %s (of %llu recorded) into %s\n", t->n_records, t->job,
           (unsigned long long)t->recorded, ctl->out);
  }
  return EXIT_OK;
}

static int cmd_trace(ctl_t *ctl, int argc, char **argv) {
  if (argc < 1 || !ctl->out)
    return usage_error("%s", "trace needs a JOB and --out FILE");
  Fsdp__V1__TraceRequest request = FSDP__V1__TRACE_REQUEST__INIT;
  request.job = argv[0];
  request.steps = ctl->steps;
  ProtobufCMessage *reply = NULL;
  int r = operator_call(ctl, "Trace", &request.base, &fsdp__v1__trace_reply__descriptor, &reply);
  if (r < 0)
    return rpc_error(ctl, "Operator.Trace", r);
  r = write_trace(ctl, (const Fsdp__V1__TraceReply *)reply);
  protobuf_c_message_free_unpacked(reply, NULL);
  return r;
}

static void why_json(const Fsdp__V1__WhyReply *w) {
  json_object *o = json_object_new_object();
  json_object_object_add(o, "job", json_string(w->job));
  json_object_object_add(o, "verdict", json_string(w->verdict));
  json_object *waiting = json_object_new_array();
  for (size_t i = 0; i < w->n_waiting; i++) {
    const Fsdp__V1__WaitingCollective *c = w->waiting[i];
    json_object *jc = json_object_new_object();
    json_object_object_add(jc, "unit", json_string(c->unit));
    json_object_object_add(jc, "what", json_string(c->what));
    json_object_object_add(jc, "step", json_object_new_uint64(c->step));
    json_object_object_add(jc, "waited_ms", json_object_new_uint64(c->waited_ms));
    json_object_object_add(jc, "asked", ranks_json(c->asked, c->n_asked));
    json_object_object_add(jc, "missing", ranks_json(c->missing, c->n_missing));
    json_object_object_add(jc, "running", json_object_new_boolean(c->running));
    json_object_object_add(jc, "across_hosts", json_object_new_boolean(c->across_hosts));
    json_object_array_add(waiting, jc);
  }
  json_object_object_add(o, "waiting", waiting);
  json_object *ranks = json_object_new_array();
  for (size_t i = 0; i < w->n_ranks; i++) {
    const Fsdp__V1__RankActivity *r = w->ranks[i];
    json_object *jr = json_object_new_object();
    json_object_object_add(jr, "rank", json_object_new_int64(r->rank));
    json_object_object_add(jr, "attached", json_object_new_boolean(r->attached));
    if (r->last) {
      json_object *l = json_object_new_object();
      json_object_object_add(l, "what", json_string(r->last->kind ==
                                                    FSDP__V1__OP_RECORD__KIND__GATHER
                                                        ? "gather" : "reduce"));
      json_object_object_add(l, "unit", json_string(r->last->unit));
      json_object_object_add(l, "step", json_object_new_uint64(r->last->step));
      json_object_object_add(l, "code", json_string(r->last->code));
      json_object_object_add(jr, "last", l);
      json_object_object_add(jr, "idle_ms", json_object_new_uint64(r->idle_ms));
    }
    json_object_array_add(ranks, jr);
  }
  json_object_object_add(o, "ranks", ranks);
  print_json(o);
}

/* "0,2" in a column of width 8, "-" for none. */
static void print_rank_column(const uint32_t *ranks, size_t n) {
  char text[256] = "-";
  size_t at = 0;
  for (size_t i = 0; i < n && at < sizeof text - 12; i++)
    at += (size_t)snprintf(text + at, sizeof text - at, "%s%" PRIu32, i ? "," : "", ranks[i]);
  printf("%-8s", text);
}

/* The most bytes a record file may hold: trace.ops' largest count of records, each of a few
 * hundred bytes packed at most. */
#define RECORD_FILE_MAX (32u << 20)

/* A flight record a collective's timeout left (fsdp_operator_write_record: a packed
 * TraceReply), read as any file the caller names may be: bounded, its fields counted before
 * it is unpacked and its contents checked as a request's (fsdp_wire_decode_request_bytes),
 * then written as trace's. */
static int cmd_record(ctl_t *ctl, int argc, char **argv) {
  if (argc < 1 || !ctl->out)
    return usage_error("%s", "record needs a FILE and --out FILE");
  /* Non-blocking: a FIFO named here is refused, not waited on for a writer. */
  int fd = open(argv[0], O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  struct stat sb;
  if (fd < 0 || fstat(fd, &sb) < 0 || !S_ISREG(sb.st_mode)) {
    fprintf(stderr, "fsdpctl: %s: %s\n", argv[0],
            fd < 0 ? strerror(errno) : "not a regular file");
    if (fd >= 0)
      close(fd);
    return EXIT_ERROR;
  }
  FILE *f = fdopen(fd, "rb");
  if (!f) {
    close(fd);
    fprintf(stderr, "fsdpctl: %s: %s\n", argv[0], strerror(errno));
    return EXIT_ERROR;
  }
  uint8_t *bytes = malloc(RECORD_FILE_MAX + 1);
  size_t n = bytes ? fread(bytes, 1, RECORD_FILE_MAX + 1, f) : 0;
  bool failed = ferror(f);
  fclose(f);
  Fsdp__V1__TraceReply *t = NULL;
  fsdp_status_t st = FSDP_STATUS_INIT;
  const char *why = !bytes ? "out of memory" : failed ? "cannot read it"
                    : n > RECORD_FILE_MAX ? "larger than any record"
                    : fsdp_wire_decode_request_bytes(&fsdp__v1__trace_reply__descriptor, bytes,
                                                     n, (ProtobufCMessage **)&t, &st) < 0
                        ? "not a flight record (it does not decode)" : NULL;
  free(bytes);
  if (!why && t->n_records > FSDP_WIRE_TRACE_RECORDS_MAX)
    why = "more records than a flight recorder keeps";
  for (size_t i = 0; !why && i < t->n_records; i++)
    if (t->records[i]->rank >= FSDP_LOCAL_WORLD_MAX)
      why = "a record of a local rank past the protocol's limit";
  if (why && t) {
    fsdp__v1__trace_reply__free_unpacked(t, NULL);
    t = NULL;
  }
  if (why) {
    fprintf(stderr, "fsdpctl: %s: %s%s%s\n", argv[0], why, st.code ? ": " : "",
            st.code ? st.message : "");
    return EXIT_ERROR;
  }
  int r = write_trace(ctl, t);
  fsdp__v1__trace_reply__free_unpacked(t, NULL);
  return r;
}

/* The verdict, each collective under way, and what each local rank last did. */
static int cmd_why(ctl_t *ctl, int argc, char **argv) {
  if (argc < 1)
    return usage_error("%s", "why needs a JOB");
  Fsdp__V1__WhyRequest request = FSDP__V1__WHY_REQUEST__INIT;
  request.job = argv[0];
  ProtobufCMessage *reply = NULL;
  int r = operator_call(ctl, "Why", &request.base, &fsdp__v1__why_reply__descriptor, &reply);
  if (r < 0)
    return rpc_error(ctl, "Operator.Why", r);
  const Fsdp__V1__WhyReply *w = (const Fsdp__V1__WhyReply *)reply;
  if (ctl->json) {
    why_json(w);
  } else {
    printf("%s\n", w->verdict);
    if (w->n_waiting)
      printf("\n%-24s %-7s %8s %9s %-8s %-8s %s\n", "UNIT", "WHAT", "STEP", "WAITED", "ASKED",
             "MISSING", "STATE");
    for (size_t i = 0; i < w->n_waiting; i++) {
      const Fsdp__V1__WaitingCollective *c = w->waiting[i];
      printf("%-24s %-7s %8llu %8.1fs ", c->unit, c->what, (unsigned long long)c->step,
             c->waited_ms / 1000.0);
      print_rank_column(c->asked, c->n_asked);
      printf(" ");
      print_rank_column(c->missing, c->n_missing);
      printf(" %s\n", c->running ? (c->across_hosts ? "running, rings among hosts" : "running")
                                 : "waiting for ranks");
    }
    printf("\n%-5s %-8s %s\n", "RANK", "SESSION", "LAST OPERATION");
    for (size_t i = 0; i < w->n_ranks; i++) {
      const Fsdp__V1__RankActivity *a = w->ranks[i];
      printf("%-5u %-8s ", a->rank, a->attached ? "yes" : "none");
      if (a->last)
        printf("%s of %s step %llu (%s), %.1f s ago\n",
               a->last->kind == FSDP__V1__OP_RECORD__KIND__GATHER ? "gather" : "reduce",
               a->last->unit, (unsigned long long)a->last->step, a->last->code,
               a->idle_ms / 1000.0);
      else
        printf("none recorded\n");
    }
  }
  protobuf_c_message_free_unpacked(reply, NULL);
  return EXIT_OK;
}

static int cmd_version(ctl_t *ctl, int argc, char **argv) {
  (void)argc, (void)argv;
  Fsdp__V1__StatusReply *s = NULL;
  int r = fetch_status(ctl, &s);
  if (ctl->json) {
    json_object *o = json_object_new_object();
    json_object *mine = json_object_new_object();
    json_object_object_add(mine, "version", json_string(FSDP_VERSION_STRING));
    json_object_object_add(mine, "protocol_version", json_object_new_int64(FSDP_PROTOCOL_VERSION));
    json_object_object_add(o, "fsdpctl", mine);
    json_object *daemon = NULL;
    if (r >= 0) {
      daemon = json_object_new_object();
      json_object_object_add(daemon, "version", json_string(s->version));
      json_object_object_add(daemon, "protocol_version", json_object_new_int64(s->protocol_version));
      json_object_object_add(daemon, "target", json_string(ctl->target));
    }
    json_object_object_add(o, "fsdpd", daemon);
    print_json(o);
  } else {
    printf("fsdpctl  %s (protocol %u)\n", FSDP_VERSION_STRING, FSDP_PROTOCOL_VERSION);
    if (r >= 0)
      printf("fsdpd    %s (protocol %" PRIu32 ") at %s\n", s->version, s->protocol_version,
             ctl->target);
  }
  if (r < 0)
    return rpc_error(ctl, "Operator.Status", r);
  if (s->protocol_version != FSDP_PROTOCOL_VERSION)
    fprintf(stderr, "fsdpctl: warning: fsdpd speaks protocol %" PRIu32 ", fsdpctl %u\n",
            s->protocol_version, FSDP_PROTOCOL_VERSION);
  protobuf_c_message_free_unpacked(&s->base, NULL);
  return EXIT_OK;
}

static int cmd_help(ctl_t *ctl, int argc, char **argv) {
  (void)ctl, (void)argc, (void)argv;
  usage(stdout);
  return EXIT_OK;
}

static const command_t commands[] = {
    {"status", NULL, 0, "", "daemon state, listeners, sessions, memory, RPC counters",
     cmd_status, false},
    {"health", NULL, 1, "[SERVICE]", "gRPC health check of the daemon or of one service",
     cmd_health, false},
    {"config", "show", 0, "", "effective configuration and where each value came from",
     cmd_config_show, false},
    {"config", "reload", 0, "", "re-read the config file (like SIGHUP), list changed keys",
     cmd_config_reload, false},
    {"peers", NULL, 0, "", "the other hosts' daemons: state, heartbeat age, RTT, last error",
     cmd_peers, false},
    {"units", NULL, 0, "", "the units of every job (or of --job J)", cmd_units, false},
    {"unit", NULL, 1, "NAME", "one unit: its parameters and shard map", cmd_unit, false},
    {"drain", NULL, 0, "", "refuse new work, keep serving health and status", cmd_drain,
     false},
    {"resume", NULL, 0, "", "serve new work again after a drain", cmd_resume, false},
    {"checkpoint", "save", 2, "JOB DIR", "write JOB's state on this host into DIR/step-N/",
     cmd_checkpoint_save, false},
    {"checkpoint", "load", 2, "JOB DIR", "read DIR (or its newest step-N/) into JOB's units",
     cmd_checkpoint_load, false},
    {"export", NULL, 1, "DIR", "a checkpoint's parameters as --out FILE (safetensors, --dtype)",
     cmd_export, true},
    {"trace", NULL, 1, "JOB", "JOB's last operations as --out FILE (Chrome trace JSON; --steps K)",
     cmd_trace, false},
    {"why", NULL, 1, "JOB", "what JOB waits for, and what each of its local ranks last did",
     cmd_why, false},
    {"record", NULL, 1, "FILE", "a record a collective's timeout left as --out FILE (Chrome "
     "trace JSON)", cmd_record, true},
    {"version", NULL, 0, "", "versions of fsdpctl and of the daemon", cmd_version, false},
    {"help", NULL, 0, "", "this text", cmd_help, true},
};
#define N_COMMANDS (sizeof commands / sizeof commands[0])

static void usage(FILE *out) {
  fputs("usage: fsdpctl [--socket PATH | --address HOST:PORT] [--json] [--verbose]\n"
        "               [--timeout DURATION] COMMAND\n\ncommands:\n",
        out);
  for (size_t i = 0; i < N_COMMANDS; i++) {
    char words[64];
    snprintf(words, sizeof words, "%s%s%s%s%s", commands[i].name, commands[i].sub ? " " : "",
             commands[i].sub ? commands[i].sub : "", *commands[i].args ? " " : "",
             commands[i].args);
    fprintf(out, "  %-24s %s\n", words, commands[i].help);
  }
  fputs("\noptions:\n"
        "  -s, --socket PATH        the daemon's unix socket (default: $FSDPD_SOCKET,\n"
        "                           else " FSDP_DEFAULT_SOCKET ")\n"
        "  -a, --address HOST:PORT  use TCP instead; fsdpd serves only health there\n"
        "  -j, --json               print one JSON object (field names as in operator.proto)\n"
        "  -v, --verbose            config show: one block per key with default, unit, help\n"
        "  -J, --job JOB            units, unit: only this job's units\n"
        "  -t, --timeout DURATION   deadline of each call: 500ms, 5s, 1m (default 5s)\n"
        "      --out FILE           export: the safetensors file to write\n"
        "      --dtype fp32|bf16|fp16  export: the tensors' type (default fp32, the masters')\n"
        "      --step N             export: DIR/step-N (default: DIR, or its newest step)\n"
        "  -h, --help               this text\n"
        "\nexit status:\n"
        "  0  success\n"
        "  1  error: the daemon could not be reached or a call failed\n"
        "  2  usage: bad option or command\n"
        "  3  not serving: health is not SERVING, or status shows DRAINING or STOPPING, or\n"
        "     peers shows a cluster that is not ready\n",
        out);
}

/* "500ms", "5s", "1.5s", "2m", "5" (seconds). */
static int parse_duration(const char *s, int *ret_ms) {
  errno = 0;
  char *end;
  double v = strtod(s, &end);
  if (end == s || errno || !isfinite(v))
    return -EINVAL;
  double scale;
  if (strcmp(end, "ms") == 0)
    scale = 1;
  else if (strcmp(end, "s") == 0 || *end == '\0')
    scale = 1000;
  else if (strcmp(end, "m") == 0)
    scale = 60000;
  else
    return -EINVAL;
  double ms = v * scale;
  if (ms < 1 || ms > MAX_TIMEOUT_MS)
    return -ERANGE;
  *ret_ms = (int)ms;
  return 0;
}

/* "unix:" + PATH, unless PATH already is a unix target. */
static char *socket_target(const char *path) {
  char *t = NULL;
  if (strncmp(path, "unix:", 5) == 0 || strncmp(path, "unix-abstract:", 14) == 0)
    t = strdup(path);
  else if (asprintf(&t, "unix:%s", path) < 0)
    t = NULL;
  return t;
}

static const command_t *find_command(int argc, char **argv, int *ret_words) {
  bool name_known = false;
  for (size_t i = 0; i < N_COMMANDS; i++) {
    const command_t *c = &commands[i];
    if (strcmp(argv[0], c->name) != 0)
      continue;
    name_known = true;
    if (!c->sub) {
      *ret_words = 1;
      return c;
    }
    if (argc > 1 && strcmp(argv[1], c->sub) == 0) {
      *ret_words = 2;
      return c;
    }
  }
  *ret_words = name_known ? -1 : 0;
  return NULL;
}

int main(int argc, char **argv) {
  static const struct option options[] = {
      {"socket", required_argument, NULL, 's'}, {"address", required_argument, NULL, 'a'},
      {"json", no_argument, NULL, 'j'},         {"verbose", no_argument, NULL, 'v'},
      {"timeout", required_argument, NULL, 't'}, {"help", no_argument, NULL, 'h'},
      {"job", required_argument, NULL, 'J'},
      {"out", required_argument, NULL, 'O'},    {"dtype", required_argument, NULL, 'D'},
      {"step", required_argument, NULL, 'S'},   {"steps", required_argument, NULL, 'K'},
      {NULL, 0, NULL, 0},
  };
  ctl_t ctl = {.timeout_ms = DEFAULT_TIMEOUT_MS};
  int opt;
  opterr = 0; /* our own messages, with the usage line */
  while ((opt = getopt_long(argc, argv, ":s:a:jvt:hJ:O:D:S:K:", options, NULL)) != -1) {
    switch (opt) {
    case 's':
      ctl.socket = optarg;
      break;
    case 'a':
      ctl.address = optarg;
      break;
    case 'j':
      ctl.json = true;
      break;
    case 'v':
      ctl.verbose = true;
      break;
    case 'J':
      ctl.job = optarg;
      break;
    case 'O':
      ctl.out = optarg;
      break;
    case 'D':
      if (parse_dtype(optarg, &ctl.dtype) < 0)
        return usage_error("--dtype '%s': expected fp32, bf16 or fp16", optarg);
      break;
    case 'S':
      if (strspn(optarg, "0123456789") != strlen(optarg) || !*optarg)
        return usage_error("--step '%s': expected a step number", optarg);
      ctl.step = optarg;
      break;
    case 'K':
      if (strspn(optarg, "0123456789") != strlen(optarg) || !*optarg || strlen(optarg) > 18)
        return usage_error("--steps '%s': expected a number of steps", optarg);
      ctl.steps = strtoull(optarg, NULL, 10);
      break;
    case 't':
      if (parse_duration(optarg, &ctl.timeout_ms) < 0)
        return usage_error("--timeout '%s': expected a duration like 500ms, 5s or 1m", optarg);
      break;
    case 'h':
      usage(stdout);
      return EXIT_OK;
    case ':':
      if (strncmp(argv[optind - 1], "--", 2) == 0)
        return usage_error("%s needs a value", argv[optind - 1]);
      return usage_error("-%c needs a value", optopt);
    default:
      if (optopt)
        return usage_error("unknown option '-%c'", optopt);
      return usage_error("unknown option '%s'", argv[optind - 1]);
    }
  }
  if (ctl.socket && ctl.address)
    return usage_error("%s", "--socket and --address exclude each other");
  if ((ctl.socket && !*ctl.socket) || (ctl.address && !*ctl.address))
    return usage_error("%s", "--socket and --address need a non-empty value");
  if (optind >= argc)
    return usage_error("%s", "no command given");

  int words;
  const command_t *cmd = find_command(argc - optind, argv + optind, &words);
  if (!cmd) {
    if (words < 0)
      return usage_error("'%s' needs a subcommand: show or reload", argv[optind]);
    return usage_error("unknown command '%s'", argv[optind]);
  }
  int nargs = argc - optind - words;
  char **args = argv + optind + words;
  if (nargs > cmd->max_args)
    return usage_error("unexpected argument '%s'", args[cmd->max_args]);
  if (cmd->offline)
    return cmd->run(&ctl, nargs, args);

  if (ctl.address) {
    ctl.target = strdup(ctl.address);
  } else {
    const char *path = ctl.socket;
    const char *env = getenv("FSDPD_SOCKET");
    if (!path)
      path = env && *env ? env : FSDP_DEFAULT_SOCKET;
    ctl.target = socket_target(path);
  }
  if (!ctl.target) {
    fprintf(stderr, "fsdpctl: out of memory\n");
    return EXIT_ERROR;
  }
  fsdp_client_options_t copts = FSDP_CLIENT_OPTIONS_INIT;
  copts.timeout_ms = ctl.timeout_ms;
  int r = fsdp_client_connect(ctl.target, &copts, &ctl.client);
  if (r < 0) {
    fprintf(stderr, "fsdpctl: connect to %s: %s\n", ctl.target, fsdp_strerror(r));
    free(ctl.target);
    return EXIT_ERROR;
  }
  int rc = cmd->run(&ctl, nargs, args);
  fsdp_client_close(ctl.client);
  free(ctl.target);
  return rc;
}
