/* The option table and the three ways to fill a config from it: an INI file through libinih,
 * FSDPD_* environment variables, and single values from command-line flags. All of them go
 * through store(), so every source validates alike and records its source and origin.
 *
 * The Debian libinih is built without INI_HANDLER_LINENO, so the handler is not told the
 * line. We feed inih through our own line reader instead: it counts lines, hands inih one
 * whole line per call (so inih's error line and ours agree) and stops the parse at the first
 * error, so that the first bad line is the one reported. */
#include "config/config.h"

#include <ctype.h>
#include <errno.h>
#include <ini.h>
#include <stdlib.h>
#include <string.h>

#include "config/config_value.h"

static const fsdp_option_t options[FSDP_OPTION_COUNT] = {
#define FSDP_OPTION_ROW(id, key, type, def, min, max, choices, unit, reloadable, flag, help) \
  [FSDP_OPTION_##id] = {key, type, def, min, max, choices, unit, reloadable, flag, help},
    FSDP_OPTIONS(FSDP_OPTION_ROW)
#undef FSDP_OPTION_ROW
};

/* A config file is a few kilobytes; the cap keeps a wrong path such as /dev/zero from eating
 * memory before the parser can complain. */
#define CONFIG_FILE_MAX (1024 * 1024)

/* The room for a key or env name: inih cuts sections and names at 50 bytes each. */
#define KEY_MAX 128

const fsdp_option_t *fsdp_option_get(fsdp_option_id_t id) {
  return (unsigned)id < FSDP_OPTION_COUNT ? &options[id] : NULL;
}

const fsdp_option_t *fsdp_option_find(const char *key, fsdp_option_id_t *ret_id) {
  for (int i = 0; key && i < FSDP_OPTION_COUNT; i++) {
    if (strcmp(options[i].key, key) == 0) {
      if (ret_id)
        *ret_id = (fsdp_option_id_t)i;
      return &options[i];
    }
  }
  return NULL;
}

const fsdp_option_t *fsdp_option_find_flag(const char *flag, fsdp_option_id_t *ret_id) {
  for (int i = 0; flag && i < FSDP_OPTION_COUNT; i++) {
    if (options[i].flag && strcmp(options[i].flag, flag) == 0) {
      if (ret_id)
        *ret_id = (fsdp_option_id_t)i;
      return &options[i];
    }
  }
  return NULL;
}

const char *fsdp_config_source_name(fsdp_config_source_t source) {
  switch (source) {
  case FSDP_SOURCE_DEFAULT:
    return "default";
  case FSDP_SOURCE_FILE:
    return "file";
  case FSDP_SOURCE_ENV:
    return "env";
  case FSDP_SOURCE_FLAG:
    return "flag";
  }
  return "unknown";
}

static bool is_text_type(fsdp_option_type_t type) {
  return type == FSDP_OPT_STRING || type == FSDP_OPT_PATH || type == FSDP_OPT_ADDRESS ||
         type == FSDP_OPT_ADDRESS_LIST;
}

/* Length of the section part of a key ("daemon" in "daemon.run_dir"). */
static size_t section_len(const char *key) {
  return strcspn(key, ".");
}

static const char *option_name(const fsdp_option_t *opt) {
  return opt->key + section_len(opt->key) + 1;
}

static bool same_section(const char *key, const char *section, size_t len) {
  return section_len(key) == len && strncmp(key, section, len) == 0;
}

/* FSDPD_<SECTION>_<NAME>: the key upper-cased with the dot as '_'. */
static void env_name(const fsdp_option_t *opt, char *buf, size_t size) {
  size_t n = (size_t)snprintf(buf, size, "FSDPD_%s", opt->key);
  for (size_t i = 0; i < n && i < size; i++)
    buf[i] = buf[i] == '.' ? '_' : (char)toupper((unsigned char)buf[i]);
}

/* "[daemon], [rpc], ..." in table order, each once. */
static void list_sections(char *buf, size_t size) {
  size_t used = 0;
  buf[0] = '\0';
  for (int i = 0; i < FSDP_OPTION_COUNT; i++) {
    size_t len = section_len(options[i].key);
    bool seen = false;
    for (int j = 0; j < i && !seen; j++)
      seen = same_section(options[j].key, options[i].key, len);
    if (!seen && used < size)
      used += (size_t)snprintf(buf + used, size - used, "%s[%.*s]", used ? ", " : "", (int)len,
                               options[i].key);
  }
}

static void list_section_keys(const char *section, char *buf, size_t size) {
  size_t used = 0;
  buf[0] = '\0';
  for (int i = 0; i < FSDP_OPTION_COUNT; i++)
    if (same_section(options[i].key, section, strlen(section)) && used < size)
      used += (size_t)snprintf(buf + used, size - used, "%s%s", used ? ", " : "",
                               option_name(&options[i]));
}

/* Validates text for option id and stores it with its source and origin; `where` opens any
 * message ("fsdpd.conf:7", "environment FSDPD_X", "--flag"). cfg is untouched on failure. */
static int store(fsdp_config_t *cfg, fsdp_option_id_t id, const char *text,
                 fsdp_config_source_t source, const char *origin, const char *where,
                 fsdp_status_t *st) {
  const fsdp_option_t *opt = &options[id];
  char why[384];
  int64_t number;
  if (fsdp_config_value_parse(opt, text, &number, why, sizeof why) < 0)
    return fsdp_status_set(st, FSDP_E_CONFIG, "%s: key '%s': %s", where, opt->key, why);
  char *copy = NULL;
  if (is_text_type(opt->type) && !(copy = strdup(text)))
    return fsdp_status_set(st, -ENOMEM, "%s: key '%s': out of memory", where, opt->key);
  fsdp_config_value_t *v = &cfg->values[id];
  free(v->text);
  v->text = copy;
  v->number = number;
  v->source = source;
  v->derived = false;
  snprintf(v->origin, sizeof v->origin, "%s", origin);
  return 0;
}

int fsdp_config_init(fsdp_config_t *cfg) {
  memset(cfg, 0, sizeof *cfg);
  for (int i = 0; i < FSDP_OPTION_COUNT; i++) {
    int r = store(cfg, (fsdp_option_id_t)i, options[i].default_value, FSDP_SOURCE_DEFAULT, "",
                  "default", NULL);
    if (r < 0) {
      fsdp_config_cleanup(cfg);
      /* Only a table bug makes a default invalid, and test_config checks every default. */
      return r == -ENOMEM ? r : FSDP_E_INTERNAL;
    }
  }
  return 0;
}

void fsdp_config_cleanup(fsdp_config_t *cfg) {
  if (!cfg)
    return;
  free(cfg->file);
  for (int i = 0; i < FSDP_OPTION_COUNT; i++)
    free(cfg->values[i].text);
  memset(cfg, 0, sizeof *cfg);
}

int fsdp_config_set(fsdp_config_t *cfg, fsdp_option_id_t id, const char *value,
                    fsdp_config_source_t source, const char *origin, fsdp_status_t *st) {
  if (!cfg || !value || (unsigned)id >= FSDP_OPTION_COUNT)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "config set: option id %d, expected 0..%d with a value", (int)id,
                           FSDP_OPTION_COUNT - 1);
  char where[FSDP_STATUS_MESSAGE_MAX];
  switch (source) {
  case FSDP_SOURCE_DEFAULT:
    origin = "";
    snprintf(where, sizeof where, "default");
    break;
  case FSDP_SOURCE_ENV:
    snprintf(where, sizeof where, "environment %s", origin ? origin : "");
    break;
  case FSDP_SOURCE_FILE:
  case FSDP_SOURCE_FLAG:
  default:
    if (!origin)
      origin = options[id].flag ? options[id].flag : fsdp_config_source_name(source);
    snprintf(where, sizeof where, "%s", origin);
    break;
  }
  return store(cfg, id, value, source, origin ? origin : "", where, st);
}

int fsdp_config_load_env(fsdp_config_t *cfg, char *const *envp, fsdp_status_t *st) {
  /* The first of repeated variables wins, as it does for getenv(). */
  bool seen[FSDP_OPTION_COUNT] = {false};
  for (char *const *e = envp; e && *e; e++) {
    const char *eq = strchr(*e, '=');
    if (strncmp(*e, "FSDPD_", 6) != 0 || !eq)
      continue;
    size_t len = (size_t)(eq - *e);
    for (int i = 0; i < FSDP_OPTION_COUNT; i++) {
      char name[KEY_MAX], where[KEY_MAX + 16];
      env_name(&options[i], name, sizeof name);
      if (strlen(name) != len || strncmp(name, *e, len) != 0)
        continue;
      if (!seen[i]) {
        seen[i] = true;
        snprintf(where, sizeof where, "environment %s", name);
        int r = store(cfg, (fsdp_option_id_t)i, eq + 1, FSDP_SOURCE_ENV, name, where, st);
        if (r < 0)
          return r;
      }
      break;
    }
  }
  return 0;
}

typedef struct load_ctx {
  fsdp_config_t *cfg;
  const char *name; /* the path, or what stands for it in messages */
  const char *pos, *end; /* the text not yet handed to inih */
  unsigned line;         /* the line inih is working on */
  unsigned set_at[FSDP_OPTION_COUNT]; /* line that set each key in this text; 0: not yet */
  int err;           /* first failure found by the reader or the handler */
  unsigned err_line;
  fsdp_status_t *st;
} load_ctx_t;

static int fail_at_line(load_ctx_t *ctx, int err) {
  ctx->err = err;
  ctx->err_line = ctx->line;
  return err;
}

/* An ini_reader. A line that would not fit in inih's buffer (num bytes) is an error here:
 * inih would silently read its tail as another line. Leading blanks are dropped so that an
 * indented line is an ordinary line rather than an inih continuation of the previous value,
 * which would show up as a puzzling "already set". */
static char *read_line(char *buf, int num, void *stream) {
  load_ctx_t *ctx = stream;
  if (ctx->err || ctx->pos >= ctx->end)
    return NULL;
  const char *start = ctx->pos;
  const char *nl = memchr(start, '\n', (size_t)(ctx->end - start));
  const char *stop = nl ? nl : ctx->end;
  ctx->pos = nl ? nl + 1 : ctx->end;
  ctx->line++;
  if (memchr(start, '\0', (size_t)(stop - start))) {
    fsdp_status_set(ctx->st, FSDP_E_CONFIG, "%s:%u: line holds a NUL byte; expected text",
                    ctx->name, ctx->line);
    fail_at_line(ctx, FSDP_E_CONFIG);
    return NULL;
  }
  while (start < stop && isspace((unsigned char)*start))
    start++;
  size_t len = (size_t)(stop - start);
  if (len > 0 && start[len - 1] == '\r')
    len--;
  /* Room for the line, '\n' and '\0', and one byte to spare for a '\r' in inih's count. */
  int max = num - 3;
  if (max < 0 || len > (size_t)max) {
    fsdp_status_set(ctx->st, FSDP_E_CONFIG, "%s:%u: line is longer than %d characters",
                    ctx->name, ctx->line, max);
    fail_at_line(ctx, FSDP_E_CONFIG);
    return NULL;
  }
  memcpy(buf, start, len);
  buf[len] = '\n';
  buf[len + 1] = '\0';
  return buf;
}

static int apply_key(load_ctx_t *ctx, const char *section, const char *name, const char *value,
                     const char *where) {
  char key[KEY_MAX], list[256];
  if (section[0] == '\0') {
    for (int i = 0; i < FSDP_OPTION_COUNT; i++)
      if (strcmp(option_name(&options[i]), name) == 0)
        return fsdp_status_set(ctx->st, FSDP_E_CONFIG,
                               "%s: key '%s' is outside any section; it belongs under [%.*s]",
                               where, name, (int)section_len(options[i].key), options[i].key);
    list_sections(list, sizeof list);
    return fsdp_status_set(ctx->st, FSDP_E_CONFIG,
                           "%s: key '%s' is outside any section; known sections: %s", where,
                           name, list);
  }
  snprintf(key, sizeof key, "%s.%s", section, name);
  fsdp_option_id_t id;
  if (!fsdp_option_find(key, &id)) {
    list_section_keys(section, list, sizeof list);
    if (list[0])
      return fsdp_status_set(ctx->st, FSDP_E_CONFIG, "%s: unknown key '%s'; known keys in [%s]: %s",
                             where, key, section, list);
    list_sections(list, sizeof list);
    return fsdp_status_set(ctx->st, FSDP_E_CONFIG,
                           "%s: key '%s': unknown section [%s]; known sections: %s", where, key,
                           section, list);
  }
  if (ctx->set_at[id])
    return fsdp_status_set(ctx->st, FSDP_E_CONFIG, "%s: key '%s' already set at line %u", where,
                           key, ctx->set_at[id]);

  /* The origin keeps the end of a long path: the line number is what a reader needs most. */
  char origin[sizeof ctx->cfg->values[0].origin], line[16];
  int line_len = snprintf(line, sizeof line, ":%u", ctx->line);
  size_t room = sizeof origin - 1 - (size_t)line_len, path_len = strlen(ctx->name);
  if (path_len <= room)
    snprintf(origin, sizeof origin, "%s%s", ctx->name, line);
  else
    snprintf(origin, sizeof origin, "...%s%s", ctx->name + path_len - (room - 3), line);
  int r = store(ctx->cfg, id, value, FSDP_SOURCE_FILE, origin, where, ctx->st);
  if (r < 0)
    return r;
  ctx->set_at[id] = ctx->line;
  return 0;
}

/* The ini_handler: nonzero to go on. */
static int on_key(void *user, const char *section, const char *name, const char *value) {
  load_ctx_t *ctx = user;
  if (ctx->err)
    return 0;
  char where[FSDP_STATUS_MESSAGE_MAX];
  snprintf(where, sizeof where, "%s:%u", ctx->name, ctx->line);
  int r = apply_key(ctx, section, name, value, where);
  if (r < 0) {
    fail_at_line(ctx, r);
    return 0;
  }
  return 1;
}

/* inih reports only the number of a line it could not parse; describe it from the text. */
static int syntax_error(const load_ctx_t *ctx, const char *text, size_t size, unsigned lineno) {
  const char *s = text, *end = text + size;
  for (unsigned i = 1; i < lineno && s < end; i++) {
    const char *nl = memchr(s, '\n', (size_t)(end - s));
    s = nl ? nl + 1 : end;
  }
  const char *stop = memchr(s, '\n', (size_t)(end - s));
  if (!stop)
    stop = end;
  while (s < stop && isspace((unsigned char)*s))
    s++;
  while (stop > s && isspace((unsigned char)stop[-1]))
    stop--;
  int len = (int)(stop - s > 64 ? 64 : stop - s);
  const char *more = stop - s > 64 ? "..." : "";
  if (*s == '[')
    return fsdp_status_set(ctx->st, FSDP_E_CONFIG,
                           "%s:%u: section header '%.*s%s' has no closing ']'", ctx->name, lineno,
                           len, s, more);
  return fsdp_status_set(ctx->st, FSDP_E_CONFIG,
                         "%s:%u: '%.*s%s' is not 'name = value', '[section]' or a comment",
                         ctx->name, lineno, len, s, more);
}

static int load_text(fsdp_config_t *cfg, const char *text, size_t size, const char *name,
                     fsdp_status_t *st) {
  load_ctx_t ctx = {.cfg = cfg, .name = name, .pos = text, .end = text + size, .st = st};
  int r = ini_parse_stream(read_line, &ctx, on_key, &ctx);
  if (r < 0)
    return fsdp_status_set(st, -ENOMEM, "%s: out of memory while parsing", name);
  /* inih goes on after a line it cannot parse, so a later bad value may have been seen too;
   * the earlier line is the one to report. */
  if (r > 0 && (ctx.err == 0 || (unsigned)r < ctx.err_line))
    return syntax_error(&ctx, text, size, (unsigned)r);
  return ctx.err;
}

int fsdp_config_load_string(fsdp_config_t *cfg, const char *text, const char *name,
                            fsdp_status_t *st) {
  return load_text(cfg, text, strlen(text), name ? name : "(string)", st);
}

int fsdp_config_load_file(fsdp_config_t *cfg, const char *path, fsdp_status_t *st) {
  char errbuf[128];
  FILE *f = fopen(path, "re");
  if (!f)
    return fsdp_status_set(st, FSDP_E_CONFIG, "cannot read config file '%s': %s", path,
                           strerror_r(errno, errbuf, sizeof errbuf));
  char *text = malloc(CONFIG_FILE_MAX + 1);
  if (!text) {
    fclose(f);
    return fsdp_status_set(st, -ENOMEM, "cannot read config file '%s': out of memory", path);
  }
  /* One byte past the cap tells a file at the cap from a larger one. */
  size_t size = fread(text, 1, CONFIG_FILE_MAX + 1, f);
  int r = 0;
  if (ferror(f))
    r = fsdp_status_set(st, FSDP_E_CONFIG, "cannot read config file '%s': %s", path,
                        strerror_r(errno, errbuf, sizeof errbuf));
  else if (size > CONFIG_FILE_MAX)
    r = fsdp_status_set(st, FSDP_E_CONFIG, "config file '%s' is larger than %d bytes", path,
                        CONFIG_FILE_MAX);
  fclose(f);
  if (r == 0)
    r = load_text(cfg, text, size, path, st);
  free(text);
  if (r < 0)
    return r;
  char *copy = strdup(path);
  if (!copy)
    return fsdp_status_set(st, -ENOMEM, "%s: out of memory", path);
  free(cfg->file);
  cfg->file = copy;
  return 0;
}

int64_t fsdp_config_number(const fsdp_config_t *cfg, fsdp_option_id_t id) {
  return (unsigned)id < FSDP_OPTION_COUNT ? cfg->values[id].number : 0;
}

const char *fsdp_config_text(const fsdp_config_t *cfg, fsdp_option_id_t id) {
  return (unsigned)id < FSDP_OPTION_COUNT ? cfg->values[id].text : NULL;
}

int fsdp_config_format(const fsdp_config_t *cfg, fsdp_option_id_t id, char *buf, size_t size) {
  if (!cfg || (unsigned)id >= FSDP_OPTION_COUNT)
    return -EINVAL;
  if (!is_text_type(options[id].type))
    return fsdp_config_value_format(&options[id], cfg->values[id].number, buf, size);
  const char *text = cfg->values[id].text ? cfg->values[id].text : "";
  int len = snprintf(buf, size, "%s", text);
  return (size_t)len < size ? len : -ENOSPC;
}

size_t fsdp_config_diff(const fsdp_config_t *old_cfg, const fsdp_config_t *new_cfg,
                        fsdp_option_id_t *ret_ids) {
  size_t n = 0;
  for (int i = 0; i < FSDP_OPTION_COUNT; i++) {
    const fsdp_config_value_t *a = &old_cfg->values[i], *b = &new_cfg->values[i];
    bool same_text = (!a->text && !b->text) || (a->text && b->text && strcmp(a->text, b->text) == 0);
    if (a->number != b->number || !same_text) {
      if (ret_ids)
        ret_ids[n] = (fsdp_option_id_t)i;
      n++;
    }
  }
  return n;
}

unsigned fsdp_config_host_count(const fsdp_config_t *cfg) {
  const char *hosts = fsdp_config_text(cfg, FSDP_OPTION_CLUSTER_HOSTS);
  return hosts ? fsdp_config_value_list_count(hosts) : 0;
}

int fsdp_config_host(const fsdp_config_t *cfg, unsigned i, char *buf, size_t size) {
  const char *hosts = fsdp_config_text(cfg, FSDP_OPTION_CLUSTER_HOSTS);
  if (!hosts || i >= fsdp_config_value_list_count(hosts))
    return -ENOENT;
  return fsdp_config_value_list_item(hosts, i, buf, size);
}

int fsdp_address_port(const char *address) {
  const char *colon = address ? strrchr(address, ':') : NULL;
  if (!colon || !colon[1])
    return -1;
  int port = 0;
  for (const char *c = colon + 1; *c; c++) {
    if (*c < '0' || *c > '9' || port > 65535)
      return -1;
    port = port * 10 + (*c - '0');
  }
  return port <= 65535 ? port : -1;
}

/* Where a value came from, for messages: " (from --hosts)", " (from fsdpd.conf:3)". */
static const char *from(const fsdp_config_t *cfg, fsdp_option_id_t id, char *buf, size_t size) {
  const fsdp_config_value_t *v = &cfg->values[id];
  if (v->source == FSDP_SOURCE_DEFAULT)
    snprintf(buf, size, " (the default)");
  else
    snprintf(buf, size, " (from %s)", v->origin);
  return buf;
}

/* The least memory.limit and memory.job_limit other than 0, and the unit derived values
 * are rounded down to (the largest page an arena uses). */
#define MEMORY_MIN ((int64_t)64 << 20)
#define MEMORY_ROUND ((int64_t)2 << 20)

static void derive_size(fsdp_config_t *cfg, fsdp_option_id_t id, int64_t bytes,
                        const char *how) {
  fsdp_config_value_t *v = &cfg->values[id];
  bytes = bytes / MEMORY_ROUND * MEMORY_ROUND;
  if (bytes < MEMORY_MIN)
    bytes = MEMORY_MIN;
  if (bytes > options[id].max)
    bytes = options[id].max;
  v->number = bytes;
  v->derived = true;
  snprintf(v->origin, sizeof v->origin, "%s%.80s", v->source == FSDP_SOURCE_DEFAULT ? "" : "0: ",
           how);
}

int fsdp_config_derive(fsdp_config_t *cfg, uint64_t host_memory, fsdp_status_t *st) {
  static const fsdp_option_id_t sizes[2] = {FSDP_OPTION_MEMORY_LIMIT, FSDP_OPTION_JOB_MEMORY};
  char a[128], min[32];
  for (int i = 0; i < 2; i++) {
    int64_t v = fsdp_config_number(cfg, sizes[i]);
    if (v != 0 && v < MEMORY_MIN) {
      fsdp_config_value_format(&options[sizes[i]], MEMORY_MIN, min, sizeof min);
      return fsdp_status_set(st, FSDP_E_CONFIG,
                             "key '%s': value %lld bytes%s is below %s; 0 derives it from the "
                             "host's memory",
                             options[sizes[i]].key, (long long)v, from(cfg, sizes[i], a, sizeof a),
                             min);
    }
  }
  if (fsdp_config_number(cfg, FSDP_OPTION_MEMORY_LIMIT) == 0) {
    char host[32], how[96];
    int64_t half = (int64_t)(host_memory > INT64_MAX ? INT64_MAX : host_memory) / 2;
    fsdp_config_value_format(&options[FSDP_OPTION_MEMORY_LIMIT],
                             (int64_t)(host_memory > INT64_MAX ? INT64_MAX : host_memory) /
                                 MEMORY_ROUND * MEMORY_ROUND,
                             host, sizeof host);
    snprintf(how, sizeof how, "half of the host's %s", host);
    derive_size(cfg, FSDP_OPTION_MEMORY_LIMIT, half, how);
  }
  if (fsdp_config_number(cfg, FSDP_OPTION_JOB_MEMORY) == 0) {
    /* A GPU's arenas are its memory, made whole with the job, which the host's says nothing
     * of. */
    if (fsdp_config_number(cfg, FSDP_OPTION_BACKEND) == 1 /* cuda */)
      derive_size(cfg, FSDP_OPTION_JOB_MEMORY, (int64_t)1 << 30, "1GiB with backend cuda");
    else
      derive_size(cfg, FSDP_OPTION_JOB_MEMORY,
                  fsdp_config_number(cfg, FSDP_OPTION_MEMORY_LIMIT) / 4,
                  "a quarter of memory.limit");
  }
  return 0;
}

void fsdp_config_keep_derived(fsdp_config_t *next, const fsdp_config_t *running) {
  for (int i = 0; i < FSDP_OPTION_COUNT; i++) {
    fsdp_config_value_t *v = &next->values[i];
    const fsdp_config_value_t *was = &running->values[i];
    if (!options[i].reloadable && v->derived && was->derived) {
      v->number = was->number;
      memcpy(v->origin, was->origin, sizeof v->origin);
    }
  }
}

int fsdp_config_check(const fsdp_config_t *cfg, fsdp_status_t *st) {
  char a[128], b[128], addr[FSDP_CONFIG_ADDRESS_MAX];
  unsigned n = fsdp_config_host_count(cfg);
  int64_t rank = fsdp_config_number(cfg, FSDP_OPTION_CLUSTER_HOST_RANK);
  int64_t lws = fsdp_config_number(cfg, FSDP_OPTION_CLUSTER_LOCAL_WORLD_SIZE);
  int64_t g = fsdp_config_number(cfg, FSDP_OPTION_CLUSTER_SHARD_GROUP_HOSTS);
  unsigned hosts = n ? n : 1;
  if (rank >= (int64_t)hosts)
    return fsdp_status_set(st, FSDP_E_CONFIG,
                           "key 'cluster.host_rank': value %lld%s is not below the number of "
                           "hosts, %u in cluster.hosts%s",
                           (long long)rank, from(cfg, FSDP_OPTION_CLUSTER_HOST_RANK, a, sizeof a),
                           n, n ? "" : " (empty: one host, rank 0)");
  if (g > (int64_t)hosts || hosts % (unsigned)g != 0)
    return fsdp_status_set(st, FSDP_E_CONFIG,
                           "key 'cluster.shard_group_hosts': value %lld%s does not divide the "
                           "number of hosts, %u: a shard group is whole hosts, S divides N",
                           (long long)g, from(cfg, FSDP_OPTION_CLUSTER_SHARD_GROUP_HOSTS, a, sizeof a),
                           hosts);
  const char *checkpoints = fsdp_config_text(cfg, FSDP_OPTION_CHECKPOINT_DIR);
  if (checkpoints[0] && checkpoints[0] != '/')
    return fsdp_status_set(st, FSDP_E_CONFIG,
                           "key 'checkpoint.dir': value '%s'%s: expected an absolute path",
                           checkpoints, from(cfg, FSDP_OPTION_CHECKPOINT_DIR, a, sizeof a));
  if (n > 1 && lws == 0)
    return fsdp_status_set(st, FSDP_E_CONFIG,
                           "key 'cluster.local_world_size' is required with %u hosts in "
                           "cluster.hosts: set it to the number of trainers per host",
                           n);
  const char *listen = fsdp_config_text(cfg, FSDP_OPTION_PEER_LISTEN);
  if (n > 0 && listen[0]) {
    fsdp_config_host(cfg, (unsigned)rank, addr, sizeof addr);
    if (fsdp_address_port(listen) != fsdp_address_port(addr))
      return fsdp_status_set(st, FSDP_E_CONFIG,
                             "key 'peer.listen': value '%s'%s has another port than this host's "
                             "entry cluster.hosts[%lld] = '%s'; the ports must be equal",
                             listen, from(cfg, FSDP_OPTION_PEER_LISTEN, a, sizeof a),
                             (long long)rank, addr);
  }
  static const fsdp_option_id_t tls[3] = {FSDP_OPTION_PEER_TLS_CERT, FSDP_OPTION_PEER_TLS_KEY,
                                          FSDP_OPTION_PEER_TLS_CA};
  int set = 0;
  for (int i = 0; i < 3; i++)
    set += fsdp_config_text(cfg, tls[i])[0] != '\0';
  if (set != 0 && set != 3) {
    a[0] = b[0] = '\0';
    for (int i = 0; i < 3; i++) {
      bool on = fsdp_config_text(cfg, tls[i])[0] != '\0';
      char *buf = on ? a : b;
      size_t len = strlen(buf);
      snprintf(buf + len, sizeof a - len, "%s%s", len ? ", " : "", options[tls[i]].key);
    }
    return fsdp_status_set(st, FSDP_E_CONFIG,
                           "peer TLS is all or none: %s %s set but %s %s empty", a,
                           set == 1 ? "is" : "are", b, set == 2 ? "is" : "are");
  }
  /* A Watch holds its connection busy: if the streams could fill every connection of the
   * health port, nobody could connect to probe. */
  int64_t conns = fsdp_config_number(cfg, FSDP_OPTION_HEALTH_MAX_CONNECTIONS);
  int64_t streams = fsdp_config_number(cfg, FSDP_OPTION_MAX_STREAMS);
  if (conns <= streams)
    return fsdp_status_set(st, FSDP_E_CONFIG,
                           "key 'health.max_connections': value %lld%s must exceed "
                           "rpc.max_streams = %lld%s, so that Watch streams, each on a "
                           "connection of its own, cannot fill every connection of the port",
                           (long long)conns,
                           from(cfg, FSDP_OPTION_HEALTH_MAX_CONNECTIONS, a, sizeof a),
                           (long long)streams, from(cfg, FSDP_OPTION_MAX_STREAMS, b, sizeof b));
  /* Whoever reaches a peer port unchallenged can join as a host and hand this daemon
   * data-plane addresses; that takes a decision, not a default. */
  if (n > 1 && set == 0 && !fsdp_config_text(cfg, FSDP_OPTION_PEER_TOKEN_FILE)[0] &&
      !fsdp_config_number(cfg, FSDP_OPTION_PEER_INSECURE))
    return fsdp_status_set(st, FSDP_E_CONFIG,
                           "peering %u hosts needs a token (key 'peer.token_file') or mutual "
                           "TLS (keys 'peer.tls_cert', 'peer.tls_key', 'peer.tls_ca'); set "
                           "key 'peer.insecure' = true to peer without either on purpose",
                           n);
  return 0;
}

/* Writes text as "# " comment lines of at most `width` columns, breaking at spaces. */
static void write_wrapped(FILE *out, const char *text, size_t width) {
  while (*text) {
    size_t len = strlen(text);
    if (len > width - 2) {
      len = width - 2;
      while (len > 0 && text[len] != ' ')
        len--;
      if (len == 0)
        len = strcspn(text, " ");
    }
    fprintf(out, "# %.*s\n", (int)len, text);
    text += len;
    while (*text == ' ')
      text++;
  }
}

static void write_type(FILE *out, const fsdp_option_t *opt) {
  char lo[32], hi[32];
  fsdp_config_value_format(opt, opt->min, lo, sizeof lo);
  fsdp_config_value_format(opt, opt->max, hi, sizeof hi);
  switch (opt->type) {
  case FSDP_OPT_BOOL:
    fprintf(out, "boolean");
    break;
  case FSDP_OPT_INT:
    fprintf(out, "integer%s%s, %s to %s", opt->unit ? " in " : "", opt->unit ? opt->unit : "", lo,
            hi);
    break;
  case FSDP_OPT_SIZE:
    fprintf(out, "size, %s to %s", lo, hi);
    break;
  case FSDP_OPT_DURATION:
    fprintf(out, "duration, %s to %s", lo, hi);
    break;
  case FSDP_OPT_STRING:
    fprintf(out, "string");
    break;
  case FSDP_OPT_PATH:
    fprintf(out, "path");
    break;
  case FSDP_OPT_ENUM:
    fprintf(out, "one of %s", opt->choices);
    break;
  case FSDP_OPT_ADDRESS:
    fprintf(out, "address, HOST:PORT or [IPv6]:PORT; empty disables");
    break;
  case FSDP_OPT_ADDRESS_LIST:
    fprintf(out, "comma-separated addresses, HOST:PORT or [IPv6]:PORT, distinct");
    break;
  }
}

static const char example_header[] =
    "# fsdpd.conf: configuration of fsdpd, the sharded parameter daemon.\n"
    "#\n"
    "# Every option is listed below, commented out at its built-in default; uncomment a line\n"
    "# to change it. This file is generated from the option table in the fsdpd source, so it\n"
    "# names every option there is.\n"
    "#\n"
    "# Precedence, lowest first: built-in default < this file < environment < command-line\n"
    "# flags. The environment variable of an option is FSDPD_<SECTION>_<NAME> in upper case,\n"
    "# e.g. FSDPD_DAEMON_LOG_LEVEL; its value is taken verbatim, without trimming spaces.\n"
    "#\n"
    "# An unknown section or key, a key set twice, a line that is not 'name = value', or a bad\n"
    "# value stops start-up with exit status 78 (EX_CONFIG) and a message that names the file\n"
    "# and line. Options marked reloadable take a new value on SIGHUP; the others need a\n"
    "# restart.\n"
    "#\n"
    "# Values are case-sensitive and written without quotes; ';' after a space starts a comment.\n"
    "#   size      whole bytes, with an optional binary unit B, KiB, MiB, GiB or TiB\n"
    "#             (1KiB = 1024B). KB, MB and GB are refused rather than guessed.\n"
    "#   duration  a whole number with a unit ms, s, m or h; a bare number is refused.\n"
    "#   boolean   true|false, yes|no, on|off or 1|0.\n"
    "#   address   HOST:PORT or [IPv6]:PORT with a port 0..65535; empty disables the service.\n";

void fsdp_config_write_example(FILE *out) {
  fputs(example_header, out);
  for (int s = 0; s < FSDP_OPTION_COUNT; s++) {
    const char *section = options[s].key;
    size_t len = section_len(section);
    bool written = false;
    for (int j = 0; j < s && !written; j++)
      written = same_section(options[j].key, section, len);
    if (written)
      continue;
    fprintf(out, "\n[%.*s]\n", (int)len, section);
    for (int i = s; i < FSDP_OPTION_COUNT; i++) {
      const fsdp_option_t *opt = &options[i];
      if (!same_section(opt->key, section, len))
        continue;
      char env[KEY_MAX];
      env_name(opt, env, sizeof env);
      fputc('\n', out);
      write_wrapped(out, opt->help, 90);
      fprintf(out, "# Type: ");
      write_type(out, opt);
      fprintf(out, ". %s\n", opt->reloadable ? "Reloadable on SIGHUP." : "Not reloadable: needs a restart.");
      fprintf(out, "# Environment: %s.", env);
      if (opt->flag)
        fprintf(out, " Flag: %s.", opt->flag);
      fputc('\n', out);
      fprintf(out, "#%s =%s%s\n", option_name(opt), opt->default_value[0] ? " " : "",
              opt->default_value);
    }
  }
}
