/* fsdpd's command line, and building the effective config from it.
 *
 * Flags that set options (--run-dir, --health-listen, --log-level, --backend, and
 * --set KEY=VALUE for any option) are kept, so that a reload on SIGHUP rebuilds the config
 * with the same precedence: default < file < environment < flags. */
#ifndef FSDP_ARGS_H
#define FSDP_ARGS_H

#include <stdbool.h>

#include "common/status.h"
#include "config/config.h"

#define FSDP_MAX_FLAG_SETTINGS 64

typedef struct fsdp_flag_setting {
  fsdp_option_id_t id;
  const char *value;  /* borrowed from argv */
  char origin[96];    /* "--run-dir" or "--set daemon.run_dir" */
} fsdp_flag_setting_t;

typedef enum fsdp_args_action {
  FSDP_ARGS_RUN,
  FSDP_ARGS_CHECK_CONFIG,
  FSDP_ARGS_PRINT_EXAMPLE_CONFIG,
  FSDP_ARGS_VERSION,
  FSDP_ARGS_HELP,
} fsdp_args_action_t;

typedef struct fsdp_args {
  fsdp_args_action_t action;
  const char *config_file; /* borrowed from argv; NULL: embedded defaults */
  fsdp_flag_setting_t settings[FSDP_MAX_FLAG_SETTINGS];
  unsigned n_settings;
} fsdp_args_t;

/* Parses argv. Usage errors return -EINVAL with st naming the flag; an unknown key in
 * --set returns FSDP_E_CONFIG, like an unknown key anywhere else. */
int fsdp_args_parse(int argc, char **argv, fsdp_args_t *ret_args, fsdp_status_t *st);

/* Builds a config from defaults, the file, envp and the flags, in that order. cfg is
 * initialized here; the caller cleans it up whatever the result. */
int fsdp_args_build_config(const fsdp_args_t *args, char *const *envp, fsdp_config_t *cfg,
                           fsdp_status_t *st);

void fsdp_args_usage(FILE *out);

#endif
