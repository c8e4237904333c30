/* Command-line parsing for fsdpd. */
#include "daemon/args.h"

#include <errno.h>
#include <string.h>
#include <unistd.h>

static int add_setting(fsdp_args_t *args, fsdp_option_id_t id, const char *value,
                       const char *origin, fsdp_status_t *st) {
  if (args->n_settings == FSDP_MAX_FLAG_SETTINGS)
    return fsdp_status_set(st, -E2BIG, "%s: more than %d option flags", origin,
                           FSDP_MAX_FLAG_SETTINGS);
  fsdp_flag_setting_t *s = &args->settings[args->n_settings++];
  s->id = id;
  s->value = value;
  snprintf(s->origin, sizeof s->origin, "%s", origin);
  return 0;
}

/* Splits "--flag=value" or takes the next argument as the value. */
static const char *flag_value(int argc, char **argv, int *i, const char *arg, size_t name_len,
                              fsdp_status_t *st) {
  if (arg[name_len] == '=')
    return arg + name_len + 1;
  if (*i + 1 >= argc) {
    fsdp_status_set(st, -EINVAL, "%.*s needs a value", (int)name_len, arg);
    return NULL;
  }
  return argv[++*i];
}

int fsdp_args_parse(int argc, char **argv, fsdp_args_t *ret_args, fsdp_status_t *st) {
  fsdp_args_t args = {.action = FSDP_ARGS_RUN};
  for (int i = 1; i < argc; i++) {
    const char *arg = argv[i];
    size_t name_len = strcspn(arg, "=");
    char name[64];
    snprintf(name, sizeof name, "%.*s", (int)name_len, arg);
    fsdp_option_id_t id;

    if (strcmp(arg, "--help") == 0 || strcmp(arg, "-h") == 0) {
      args.action = FSDP_ARGS_HELP;
    } else if (strcmp(arg, "--version") == 0) {
      args.action = FSDP_ARGS_VERSION;
    } else if (strcmp(arg, "--check-config") == 0) {
      args.action = FSDP_ARGS_CHECK_CONFIG;
    } else if (strcmp(arg, "--print-example-config") == 0) {
      args.action = FSDP_ARGS_PRINT_EXAMPLE_CONFIG;
    } else if (strcmp(name, "--config") == 0) {
      if (!(args.config_file = flag_value(argc, argv, &i, arg, name_len, st)))
        return st->code;
    } else if (strcmp(name, "--set") == 0) {
      const char *kv = flag_value(argc, argv, &i, arg, name_len, st);
      if (!kv)
        return st->code;
      const char *eq = strchr(kv, '=');
      char key[64];
      snprintf(key, sizeof key, "%.*s", eq ? (int)(eq - kv) : (int)strlen(kv), kv);
      if (!eq)
        return fsdp_status_set(st, -EINVAL, "--set %s: expected KEY=VALUE", kv);
      if (!fsdp_option_find(key, &id))
        return fsdp_status_set(st, FSDP_E_CONFIG, "--set %s: unknown key '%s'", kv, key);
      char origin[80];
      snprintf(origin, sizeof origin, "--set %s", key);
      int r = add_setting(&args, id, eq + 1, origin, st);
      if (r < 0)
        return r;
    } else if (fsdp_option_find_flag(name, &id)) {
      const char *value = flag_value(argc, argv, &i, arg, name_len, st);
      if (!value)
        return st->code;
      int r = add_setting(&args, id, value, name, st);
      if (r < 0)
        return r;
    } else {
      return fsdp_status_set(st, -EINVAL, "unknown argument '%s'", arg);
    }
  }
  *ret_args = args;
  return 0;
}

int fsdp_args_build_config(const fsdp_args_t *args, char *const *envp, fsdp_config_t *cfg,
                           fsdp_status_t *st) {
  int r = fsdp_config_init(cfg);
  if (r < 0)
    return fsdp_status_set(st, r, "cannot initialize the config: %s", fsdp_strerror(r));
  if (args->config_file && (r = fsdp_config_load_file(cfg, args->config_file, st)) < 0)
    return r;
  if ((r = fsdp_config_load_env(cfg, envp, st)) < 0)
    return r;
  for (unsigned i = 0; i < args->n_settings; i++) {
    const fsdp_flag_setting_t *s = &args->settings[i];
    r = fsdp_config_set(cfg, s->id, s->value, FSDP_SOURCE_FLAG, s->origin, st);
    if (r < 0)
      return r;
  }
  /* The host's physical memory sizes memory.limit and memory.job_limit left at 0. */
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  uint64_t host_memory = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
  if ((r = fsdp_config_derive(cfg, host_memory, st)) < 0)
    return r;
  return fsdp_config_check(cfg, st);
}

void fsdp_args_usage(FILE *out) {
  fprintf(out,
          "usage: fsdpd [--config FILE] [--run-dir DIR] [--health-listen HOST:PORT]\n"
          "             [--metrics-listen HOST:PORT] [--log-level LEVEL]\n"
          "             [--backend host|cuda] [--set KEY=VALUE]...\n"
          "             [--hosts H0:P0,H1:P1,... --host-rank I --local-world-size L]\n"
          "             [--peer-listen HOST:PORT]\n"
          "       fsdpd --check-config [options]   validate the config and exit\n"
          "       fsdpd --print-example-config     print the annotated config file\n"
          "       fsdpd --version | --help\n"
          "\n"
          "Precedence: built-in default < --config file < FSDPD_<SECTION>_<NAME> < flags.\n"
          "Exit status: 0 clean stop, 1 runtime failure, 2 usage, 78 bad config.\n");
}
