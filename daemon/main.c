/* fsdpd: the per-host sharded parameter daemon. Parses the command line, builds the config
 * (default < file < environment < flags) and runs the daemon in the foreground, as systemd's
 * Type=notify expects. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <fsdp/fsdp_version.h>

#include "common/log.h"
#include "config/config.h"
#include "daemon/args.h"
#include "daemon/cluster/address_check.h"
#include "daemon/daemon.h"
#include "daemon/journal.h"
#include "daemon/rpc/rpc_server.h"

extern char **environ;

int main(int argc, char **argv) {
  /* The daemon starts itself this way to have a peer's UCX address unpacked where an abort
   * in UCX costs only that process (address_check.h). */
  if (argc == 2 && strcmp(argv[1], FSDP_ADDRESS_CHECK_FLAG) == 0)
    return fsdp_address_check_main();
  /* A trainer that disconnects mid-reply must not kill the daemon. */
  signal(SIGPIPE, SIG_IGN);
  fsdp_log_init();
  fsdp_log_set_journal_sink(fsdp_daemon_journal_sink);
  fsdp_rpc_route_log(fsdp_log_get_level());

  fsdp_args_t args;
  fsdp_status_t st;
  int r = fsdp_args_parse(argc, argv, &args, &st);
  if (r < 0) {
    fprintf(stderr, "fsdpd: %s\n", st.message);
    if (r == FSDP_E_CONFIG)
      return FSDP_EXIT_CONFIG;
    fsdp_args_usage(stderr);
    return 2;
  }
  switch (args.action) {
  case FSDP_ARGS_HELP:
    fsdp_args_usage(stdout);
    return 0;
  case FSDP_ARGS_VERSION:
    printf("fsdpd %s (protocol %u, CUDA toolkit %s)\n", FSDP_VERSION_STRING,
           FSDP_PROTOCOL_VERSION, FSDP_HAVE_CUDA ? "found at build time" : "not built in");
    return 0;
  case FSDP_ARGS_PRINT_EXAMPLE_CONFIG:
    fsdp_config_write_example(stdout);
    return 0;
  case FSDP_ARGS_CHECK_CONFIG:
  case FSDP_ARGS_RUN:
    break;
  }

  fsdp_config_t config;
  if (fsdp_args_build_config(&args, environ, &config, &st) < 0) {
    fprintf(stderr, "fsdpd: %s\n", st.message);
    fsdp_config_cleanup(&config);
    return FSDP_EXIT_CONFIG;
  }
  if (args.action == FSDP_ARGS_CHECK_CONFIG) {
    printf("fsdpd: config OK (%s)\n", config.file ? config.file : "embedded defaults");
    fsdp_config_cleanup(&config);
    return 0;
  }

  fsdp_daemon_t daemon;
  r = fsdp_daemon_start(&daemon, &args, environ, &config, &st);
  if (r < 0) {
    log_error("%s", st.message);
    return r == FSDP_E_CONFIG ? FSDP_EXIT_CONFIG : 1;
  }
  return fsdp_daemon_run(&daemon);
}
