/* fsdpd configuration: one declarative option table, and the values built from it.
 *
 * FSDP_OPTIONS below is the only list of options. Parsing (INI file through libinih,
 * environment, command-line flags), validation, `fsdpctl config show` (through
 * Operator.Status), the shipped config/fsdpd.conf and docs derive from it; a test fails if
 * the shipped file drifts from the table.
 *
 * Precedence: built-in default < file < environment (FSDPD_<SECTION>_<NAME>) < flags. Each
 * value remembers its source and origin ("file:line", "FSDPD_X", "--flag").
 *
 * A fsdp_config_t is plain caller-owned storage (init/cleanup); it is not shared between
 * threads. The daemon's loop thread owns the live one and builds a fresh one on reload. */
#ifndef FSDP_CONFIG_H
#define FSDP_CONFIG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "common/status.h"
#include "config/option.h"
#include "proto/limits.h" /* FSDP_DEFAULT_RUN_DIR */

/* Exit status for a configuration error (sysexits.h EX_CONFIG). */
#define FSDP_EXIT_CONFIG 78

/* X(id, key, type, default, min, max, choices, unit, reloadable, flag, help)
 * min/max apply to INT, SIZE and DURATION; choices is "a|b|c" for ENUM, else NULL. */
#define FSDP_OPTIONS(X)                                                                         \
  X(RUN_DIR, "daemon.run_dir", FSDP_OPT_PATH, FSDP_DEFAULT_RUN_DIR, 0, 0, NULL, NULL, false,     \
    "--run-dir",                                                                                \
    "Directory for the unix socket and the lock file; created with mode 0750.")                  \
  X(LOG_LEVEL, "daemon.log_level", FSDP_OPT_ENUM, "info", 0, 0, "error|warning|info|debug",     \
    NULL, true, "--log-level", "Least severe message the daemon logs.")                          \
  X(BACKEND, "daemon.backend", FSDP_OPT_ENUM, "host", 0, 0, "host|cuda", NULL, false,           \
    "--backend", "Where parameters live and what computes on them: host memory and the CPUs, " \
    "or one GPU's memory and its kernels through CUDA (daemon.cuda_device), shared by the "     \
    "host's trainers; with several hosts, cuda's rings among them go through pinned host "    \
    "memory.")                                                                                   \
  X(CUDA_DEVICE, "daemon.cuda_device", FSDP_OPT_INT, "0", 0, 15, NULL, NULL, false, NULL,       \
    "With backend = cuda: the ordinal of the GPU whose memory holds the jobs' buffers.")       \
  X(HOUSEKEEPING_INTERVAL, "daemon.housekeeping_interval", FSDP_OPT_DURATION, "1s", 10, 60000,  \
    NULL, "ms", true, NULL,                                                                      \
    "Period of the timer that expires deadlines and updates statistics; the systemd watchdog "  \
    "is pinged at least twice per WatchdogSec regardless.")                                      \
  X(DRAIN_TIMEOUT, "daemon.drain_timeout", FSDP_OPT_DURATION, "5s", 0, 600000, NULL, "ms",      \
    true, NULL, "On SIGTERM, how long in-flight calls may run before they are cancelled.")       \
  X(OPERATOR_GROUP, "daemon.operator_group", FSDP_OPT_STRING, "", 0, 0, NULL, NULL, true, NULL, \
    "Group (name or gid) whose members may call the Operator methods that change the daemon's " \
    "state (Drain, Resume, ReloadConfig), besides root and the daemon's own user; empty: only "  \
    "those. Status, ListUnits and DescribeUnit are open to whoever may use the socket.")         \
  X(MAX_MESSAGE_SIZE, "rpc.max_message_size", FSDP_OPT_SIZE, "16MiB", 4096, 1073741824, NULL,   \
    "B", false, NULL, "Largest request or reply; a larger request gets RESOURCE_EXHAUSTED.")     \
  X(MAX_INFLIGHT_CALLS, "rpc.max_inflight_calls", FSDP_OPT_INT, "1024", 1, 1000000, NULL, NULL, \
    true, NULL,                                                                                  \
    "Calls the unix socket holds at once, counted apart for work (Trainer) and for health and " \
    "operator calls; beyond either, RESOURCE_EXHAUSTED.")                                        \
  X(MAX_STREAMS, "rpc.max_streams", FSDP_OPT_INT, "64", 1, 100000, NULL, NULL, false, NULL,       \
    "Health Watch streams each endpoint holds at once, a budget apart from its calls; beyond "  \
    "it, RESOURCE_EXHAUSTED.")                                                                   \
  X(IDLE_TIMEOUT, "rpc.idle_timeout", FSDP_OPT_DURATION, "2m", 1000, 86400000, NULL, "ms",       \
    false, NULL,                                                                                 \
    "A connection without a call for this long is closed; clients reconnect when they call "    \
    "again.")                                                                                    \
  X(MAX_CONNECTIONS_PER_UID, "rpc.max_connections_per_uid", FSDP_OPT_INT, "512", 1, 65536, NULL, \
    NULL, true, NULL,                                                                            \
    "Connections one user may hold on each unix socket, the gRPC one and the memory "           \
    "channel's; at the limit the user's oldest idle connection is closed for a new one, or the " \
    "new one is refused.")                                                                       \
  X(HEALTH_LISTEN, "health.listen", FSDP_OPT_ADDRESS, "127.0.0.1:7071", 0, 0, NULL, NULL,       \
    false, "--health-listen",                                                                    \
    "TCP address of the gRPC health service for schedulers; empty disables it.")                \
  X(HEALTH_MAX_CONNECTIONS, "health.max_connections", FSDP_OPT_INT, "128", 1, 65536, NULL,      \
    NULL, true, NULL,                                                                            \
    "Connections the health port holds, more than rpc.max_streams; at the limit the oldest "    \
    "idle one is closed for a new one, or the new one is refused.")                              \
  X(HEALTH_STALL_AFTER, "health.stall_after", FSDP_OPT_DURATION, "10s", 100, 3600000, NULL,    \
    "ms", true, NULL,                                                                            \
    "A job's health service (fsdp.job.<name>) is NOT_SERVING while one of its collectives has " \
    "been under way this long (its ranks not all there, or its rings among hosts waiting), and " \
    "the log says what it waits for; the daemon's own health stays SERVING.")                   \
  X(METRICS_LISTEN, "metrics.listen", FSDP_OPT_ADDRESS, "127.0.0.1:9464", 0, 0, NULL, NULL,     \
    false, "--metrics-listen",                                                                   \
    "TCP address of the Prometheus metrics endpoint (HTTP, GET /metrics); empty disables it. "  \
    "The metrics name the jobs and units: keep it on the loopback or behind a firewall.")       \
  X(TRACE_OPS, "trace.ops", FSDP_OPT_INT, "4096", 0, 65536, NULL, NULL, true, NULL,          \
    "Operations each job's flight recorder keeps, its last ones (each rank's gathers and "      \
    "reduces, the daemon's work), for fsdpctl trace; 0 keeps none. A job takes the value of "   \
    "its first registration.")                                                                   \
  X(MEMORY_LIMIT, "memory.limit", FSDP_OPT_SIZE, "0B", 0, 1099511627776, NULL, "B", true, NULL, \
    "Host memory the jobs' arenas may hold together: each job reserves both of its arenas "    \
    "whole (2 x memory.job_limit, what its trainers can make resident) when it is created; a " \
    "job that does not fit is refused with RESOURCE_EXHAUSTED once no retained job is left "   \
    "to free. 0: half of the host's memory; else at least 64MiB.")                              \
  X(JOB_MEMORY, "memory.job_limit", FSDP_OPT_SIZE, "0B", 0, 1099511627776, NULL, "B", false,    \
    NULL,                                                                                        \
    "Size of each of a job's two memory arenas (memfds every local rank maps: the unsharded "   \
    "buffers, read-only, and the rest); its buffers come out of them, RESOURCE_EXHAUSTED "      \
    "beyond. Both count whole against memory.limit. 0: a quarter of memory.limit, so that two " \
    "jobs fit at once (with daemon.backend = cuda, whose arenas are the GPU's memory, 1GiB); "  \
    "else at least 64MiB.")                                                                      \
  X(COLLECTIVE_TIMEOUT, "store.collective_timeout", FSDP_OPT_DURATION, "30s", 100, 3600000,     \
    NULL, "ms", true, NULL,                                                                      \
    "How long a collective (the gather of a new step, a ReduceScatter) waits for every local "  \
    "rank to ask, naming in every waiter's ABORTED the ranks that did not; also the deadline "  \
    "of each ring among hosts once it starts.")                                                  \
  X(MAX_INFLIGHT, "store.max_inflight", FSDP_OPT_INT, "2", 1, 64, NULL, NULL, true, NULL,        \
    "How many units' unsharded copies a job's local ranks hold at once (being computed or "     \
    "prefetched), and how many full-gradient buffers each rank holds: FSDP's "                  \
    "limit_all_gathers. A gather past it waits for a copy to be let go (under "                 \
    "store.collective_timeout). A job's SetSchedule may set its own.")                          \
  X(JOB_RETENTION, "store.job_retention", FSDP_OPT_DURATION, "10m", 100, 604800000, NULL, "ms",  \
    true, NULL,                                                                                  \
    "How long a job's units and memory outlive its last session, so that trainers can attach "  \
    "again and go on; then they are freed, or sooner when a new job needs the slot or the "    \
    "memory (the job idle longest first).")                                                      \
  X(RECOVER_FROM_REPLICAS, "store.recover_from_replicas", FSDP_OPT_BOOL, "true", 0, 0, NULL,   \
    NULL, true, NULL,                                                                            \
    "With several hosts and replicas (cluster.shard_group_hosts below the hosts), a job new to " \
    "this daemon (after a restart, or on a spare taking the host's rank) first asks the hosts " \
    "that replicate its shards whether they hold it trained; one that does gives it its step, " \
    "and at its first gather its shards, optimizer state and step counts, copied from that "    \
    "host's memory over UCX and checked, with no disk read. A job no replica holds goes on to " \
    "checkpoint.resume.")                                                                        \
  X(CHECKPOINT_DIR, "checkpoint.dir", FSDP_OPT_STRING, "", 0, 0, NULL, NULL, true, NULL,        \
    "Where the daemon saves jobs on its own (checkpoint.every_steps, .on_stop) and resumes "   \
    "them from (checkpoint.resume), an absolute path, made if missing: "                        \
    "<dir>/<job>/step-N/; empty: it does not.")                                                  \
  X(CHECKPOINT_EVERY_STEPS, "checkpoint.every_steps", FSDP_OPT_INT, "0", 0, 100000000, NULL,    \
    NULL, true, NULL,                                                                            \
    "With checkpoint.dir: save each job on this host every this many steps, when every local "  \
    "rank has asked the forward's gather of the next step (their masters are final); 0: "       \
    "never.")                                                                                    \
  X(CHECKPOINT_KEEP, "checkpoint.keep", FSDP_OPT_INT, "0", 0, 100000, NULL, NULL, true, NULL,   \
    "How many checkpoints a job's directory keeps after each save, the newest; 0: all.")        \
  X(CHECKPOINT_WRITE_RATE, "checkpoint.write_rate", FSDP_OPT_SIZE, "0B", 0, 1099511627776,    \
    NULL, "B", true, NULL,                                                                       \
    "Bytes per second any save writes at most, for the disk's or a shared filesystem's sake; "  \
    "a save then lasts at least as long as its bytes take at this rate. 0: no cap. A stop's "   \
    "saves write at full speed.")                                                                \
  X(CHECKPOINT_DISK_SHARE, "checkpoint.disk_share", FSDP_OPT_INT, "25", 1, 100, NULL, NULL,     \
    true, NULL,                                                                                  \
    "The share of the time, in percent, that a save of checkpoint.every_steps keeps the disk " \
    "writing at most, as training goes on: after each chunk it waits until its writes have "   \
    "taken no more than this share of the time since its file opened, so that it writes at "   \
    "this share of the disk's speed, whatever that is, and leaves the rest to training (its "  \
    "own reads and writes and, on a virtual disk, the CPU that writes take); 100: back to "    \
    "back. A save that a caller waits for (SaveCheckpoint) and a stop's write at full speed.") \
  X(CHECKPOINT_RESUME, "checkpoint.resume", FSDP_OPT_ENUM, "none", 0, 0, "none|latest", NULL,   \
    true, NULL,                                                                                  \
    "With checkpoint.dir, latest: a job new to this daemon (after a restart) goes on from its "  \
    "newest checkpoint there, loaded before its first gather; its units report that step as "   \
    "reduced, so attaching trainers resume after it. none: jobs start anew.")                   \
  X(CHECKPOINT_ON_STOP, "checkpoint.on_stop", FSDP_OPT_BOOL, "true", 0, 0, NULL, NULL, true,     \
    NULL,                                                                                        \
    "With checkpoint.dir: on SIGTERM or SIGINT, each job that trained a step is saved before "   \
    "the daemon stops, at once when it is between steps, else at its next step boundary; a "    \
    "second signal stops at once.")                                                              \
  X(CHECKPOINT_STOP_TIMEOUT, "checkpoint.stop_timeout", FSDP_OPT_DURATION, "1m", 100,          \
    3600000, NULL, "ms", true, NULL,                                                             \
    "How long a stop waits for those saves, their writing included; then it stops without the " \
    "ones left. systemd's TimeoutStopSec must cover it and daemon.drain_timeout.")              \
  X(SESSION_LEASE, "session.lease", FSDP_OPT_DURATION, "30s", 100, 3600000, NULL, "ms", true,   \
    NULL,                                                                                        \
    "A trainer session that makes no call (KeepAlive included) for this long ends; its "        \
    "references are released.")                                                                  \
  X(MAX_SESSIONS, "session.max_sessions", FSDP_OPT_INT, "256", 1, 4096, NULL, NULL, true, NULL, \
    "Trainer sessions the daemon holds at once, all jobs together, and jobs it holds at once "  \
    "(jobs cost descriptors); beyond it, RESOURCE_EXHAUSTED.")                                   \
  X(CLUSTER_HOSTS, "cluster.hosts", FSDP_OPT_ADDRESS_LIST, "", 0, 0, NULL, NULL, false,         \
    "--hosts",                                                                                   \
    "The Peer address (HOST:PORT) of every host's fsdpd, in host-rank order, comma-separated; " \
    "identical on every host. Empty: this daemon is the only host.")                            \
  X(CLUSTER_HOST_RANK, "cluster.host_rank", FSDP_OPT_INT, "0", 0, 4095, NULL, NULL, false,      \
    "--host-rank", "This host's rank: its position in cluster.hosts, from 0.")                  \
  X(CLUSTER_LOCAL_WORLD_SIZE, "cluster.local_world_size", FSDP_OPT_INT, "0", 0, 256, NULL,      \
    NULL, false, "--local-world-size",                                                          \
    "Trainers (local ranks) per host, the same on every host; required with several hosts. "    \
    "0: one host, any number of local ranks per job.")                                           \
  X(CLUSTER_SHARD_GROUP_HOSTS, "cluster.shard_group_hosts", FSDP_OPT_INT, "1", 1, 4096, NULL,   \
    NULL, false, NULL,                                                                           \
    "Hosts per HYBRID_SHARD shard group (g): a shard group is whole hosts, so g must divide "    \
    "the number of hosts.")                                                                      \
  X(PEER_LISTEN, "peer.listen", FSDP_OPT_ADDRESS, "", 0, 0, NULL, NULL, false, "--peer-listen", \
    "TCP address of this daemon's Peer service. Empty: cluster.hosts[host_rank] itself. Its "   \
    "port must equal that entry's port (the host part may differ, e.g. 0.0.0.0).")             \
  X(PEER_HEARTBEAT_INTERVAL, "peer.heartbeat_interval", FSDP_OPT_DURATION, "1s", 10, 60000,     \
    NULL, "ms", true, NULL, "How often this daemon sends each joined peer a Heartbeat.")        \
  X(PEER_TIMEOUT, "peer.timeout", FSDP_OPT_DURATION, "5s", 50, 600000, NULL, "ms", true, NULL,  \
    "A peer that answers nothing for this long is LOST; whoever waits on it gets an error "     \
    "naming the host.")                                                                          \
  X(PEER_JOIN_TIMEOUT, "peer.join_timeout", FSDP_OPT_DURATION, "2m", 100, 86400000, NULL, "ms", \
    false, NULL,                                                                                 \
    "How long after start every peer has to join both ways; then whoever waits for the "        \
    "cluster gets UNAVAILABLE naming the hosts missing. Joining goes on after it.")             \
  X(PEER_ADDRESS_CHECK_TIMEOUT, "peer.address_check_timeout", FSDP_OPT_DURATION, "10s", 100,   \
    600000, NULL, "ms", false, NULL,                                                             \
    "How long the check of a peer's data-plane (UCX) address may take: UCX unpacks it in a "    \
    "process of its own first, so that an address it cannot parse never reaches this "         \
    "daemon's worker; a check that takes longer is retried with the peer's next Join.")         \
  X(PEER_TOKEN_FILE, "peer.token_file", FSDP_OPT_STRING, "", 0, 0, NULL, NULL, false, NULL,     \
    "File holding the shared secret every daemon of the cluster sends and requires on the "     \
    "Peer service ('authorization: Bearer <token>'); empty: no token. Only its path is shown.") \
  X(PEER_TLS_CERT, "peer.tls_cert", FSDP_OPT_STRING, "", 0, 0, NULL, NULL, false, NULL,         \
    "PEM certificate this daemon presents on the Peer service and to peers; with "              \
    "peer.tls_key and peer.tls_ca (all or none), peers use mutual TLS.")                        \
  X(PEER_TLS_KEY, "peer.tls_key", FSDP_OPT_STRING, "", 0, 0, NULL, NULL, false, NULL,           \
    "PEM private key of peer.tls_cert.")                                                         \
  X(PEER_TLS_CA, "peer.tls_ca", FSDP_OPT_STRING, "", 0, 0, NULL, NULL, false, NULL,             \
    "PEM CA certificates a peer's certificate must chain to, both ways.")                        \
  X(PEER_INSECURE, "peer.insecure", FSDP_OPT_BOOL, "false", 0, 0, NULL, NULL, false, NULL,      \
    "Peer without peer.token_file or mutual TLS (peer.tls_*): anyone who reaches the peer "     \
    "port can then join as a host. With several hosts one of the three is required, so set "   \
    "this only on purpose, on a network no one else reaches.")

typedef enum fsdp_option_id {
#define FSDP_OPTION_ID(id, ...) FSDP_OPTION_##id,
  FSDP_OPTIONS(FSDP_OPTION_ID)
#undef FSDP_OPTION_ID
  FSDP_OPTION_COUNT
} fsdp_option_id_t;

typedef enum fsdp_config_source {
  FSDP_SOURCE_DEFAULT = 1,
  FSDP_SOURCE_FILE,
  FSDP_SOURCE_ENV,
  FSDP_SOURCE_FLAG,
} fsdp_config_source_t;

typedef struct fsdp_config_value {
  int64_t number; /* BOOL (0/1), INT, SIZE (bytes), DURATION (ms), ENUM (index) */
  char *text;     /* STRING, PATH, ADDRESS; owned */
  fsdp_config_source_t source;
  char origin[96]; /* "path:line", "FSDPD_X" or "--flag"; empty for defaults */
  bool derived;    /* 0 made into a value by fsdp_config_derive, which origin explains */
} fsdp_config_value_t;

typedef struct fsdp_config {
  char *file; /* the file loaded, or NULL; owned */
  fsdp_config_value_t values[FSDP_OPTION_COUNT];
} fsdp_config_t;

/* The table, indexed by fsdp_option_id_t. */
const fsdp_option_t *fsdp_option_get(fsdp_option_id_t id);
/* Lookups; NULL when there is no such option. */
const fsdp_option_t *fsdp_option_find(const char *key, fsdp_option_id_t *ret_id);
const fsdp_option_t *fsdp_option_find_flag(const char *flag, fsdp_option_id_t *ret_id);

/* Fills cfg with the built-in defaults. Cannot fail except for memory (-ENOMEM). */
int fsdp_config_init(fsdp_config_t *cfg);
/* Frees what cfg owns; accepts a zeroed or half-built cfg. */
void fsdp_config_cleanup(fsdp_config_t *cfg);

/* Parses an INI file (sections are the part of the key before the dot). Every error names
 * "path:line: key 'x': why" (unknown section or key, bad or out-of-range value, a key set
 * twice). On error cfg may hold some of the file's values: callers start from a fresh cfg. */
int fsdp_config_load_file(fsdp_config_t *cfg, const char *path, fsdp_status_t *st);
/* The same from text in memory; `name` stands for the path in messages. */
int fsdp_config_load_string(fsdp_config_t *cfg, const char *text, const char *name,
                            fsdp_status_t *st);
/* Applies FSDPD_<SECTION>_<NAME> variables found in envp (NULL-terminated "K=V" list). */
int fsdp_config_load_env(fsdp_config_t *cfg, char *const *envp, fsdp_status_t *st);
/* Sets one option from text, with its source and origin; validates like the file does. */
int fsdp_config_set(fsdp_config_t *cfg, fsdp_option_id_t id, const char *value,
                    fsdp_config_source_t source, const char *origin, fsdp_status_t *st);

/* Accessors for the parsed value. */
int64_t fsdp_config_number(const fsdp_config_t *cfg, fsdp_option_id_t id);
const char *fsdp_config_text(const fsdp_config_t *cfg, fsdp_option_id_t id);

/* The value spelled as the file would spell it ("16MiB", "5s", "info"). */
int fsdp_config_format(const fsdp_config_t *cfg, fsdp_option_id_t id, char *buf, size_t size);

/* Ids of options whose values differ between old and new (at most FSDP_OPTION_COUNT); the
 * return value is their number. */
size_t fsdp_config_diff(const fsdp_config_t *old_cfg, const fsdp_config_t *new_cfg,
                        fsdp_option_id_t *ret_ids);

/* Gives the options whose value 0 stands for one derived from the host (memory.limit from
 * host_memory, the host's physical memory in bytes; memory.job_limit from memory.limit)
 * that value, keeping its source and saying how in its origin. Errors name the key when a
 * value other than 0 is below the least one. Run after every source is applied and before
 * fsdp_config_check (fsdp_args_build_config does). */
int fsdp_config_derive(fsdp_config_t *cfg, uint64_t host_memory, fsdp_status_t *st);

/* On a reload: each option that cannot change at run time and whose value both configs
 * derived keeps the running value (memory.job_limit stays what it was at start when the
 * memory.limit it derives from is reloaded). */
void fsdp_config_keep_derived(fsdp_config_t *next, const fsdp_config_t *running);

/* Checks what no single value can: the options that must agree with each other (the
 * cluster topology, the Peer endpoint, TLS files all or none). Errors name the keys and
 * values. Run after every source is applied (fsdp_args_build_config does). */
int fsdp_config_check(const fsdp_config_t *cfg, fsdp_status_t *st);

/* The hosts of cluster.hosts: the count (0 when empty), and the i-th address copied into
 * buf (-ENOENT past the end, -ENOSPC if it does not fit). */
unsigned fsdp_config_host_count(const fsdp_config_t *cfg);
int fsdp_config_host(const fsdp_config_t *cfg, unsigned i, char *buf, size_t size);

/* The port of a valid "HOST:PORT" or "[V6]:PORT" address, or -1. */
int fsdp_address_port(const char *address);

/* Writes the annotated example file (config/fsdpd.conf) derived from the table. */
void fsdp_config_write_example(FILE *out);

/* Name of a source: "default", "file", "env", "flag". */
const char *fsdp_config_source_name(fsdp_config_source_t source);

#endif
