/* Unit tests of config/: the option table, value syntax, the file/env/flag sources and their
 * precedence, the messages a user reads (with their line numbers), and the shipped example
 * file, which must match fsdp_config_write_example() byte for byte.
 *
 * `test_config --write-example` prints the example file, to regenerate config/fsdpd.conf. */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "config/config.h"
#include "config/config_value.h"

#define NAME "fsdpd.conf"

static void init(fsdp_config_t *cfg) {
  assert_int_equal(fsdp_config_init(cfg), 0);
}

/* Loads text into a fresh config and checks that it fails with exactly `message`. */
static void expect_load_error(const char *text, const char *message) {
  fsdp_config_t cfg;
  fsdp_status_t st = FSDP_STATUS_INIT;
  init(&cfg);
  assert_int_equal(fsdp_config_load_string(&cfg, text, NAME, &st), FSDP_E_CONFIG);
  assert_int_equal(st.code, FSDP_E_CONFIG);
  assert_string_equal(st.message, message);
  fsdp_config_cleanup(&cfg);
}

/* Loads text into cfg (already initialised) and checks that it succeeds. */
static void load_ok(fsdp_config_t *cfg, const char *text) {
  fsdp_status_t st = FSDP_STATUS_INIT;
  int r = fsdp_config_load_string(cfg, text, NAME, &st);
  if (r != 0)
    fail_msg("loading %s failed: %s", text, st.message);
}

/* The canonical spelling of option id in cfg. */
static const char *formatted(const fsdp_config_t *cfg, fsdp_option_id_t id) {
  static char buf[256];
  assert_true(fsdp_config_format(cfg, id, buf, sizeof buf) >= 0);
  return buf;
}

static void test_table_is_well_formed(void **state) {
  (void)state;
  for (int i = 0; i < FSDP_OPTION_COUNT; i++) {
    const fsdp_option_t *opt = fsdp_option_get((fsdp_option_id_t)i);
    assert_non_null(opt);
    const char *dot = strchr(opt->key, '.');
    /* One dot: the section, then the name, both lower case. */
    assert_non_null(dot);
    assert_null(strchr(dot + 1, '.'));
    assert_true(dot > opt->key && dot[1] != '\0');
    for (const char *c = opt->key; *c; c++)
      assert_true((*c >= 'a' && *c <= 'z') || *c == '_' || *c == '.' || (*c >= '0' && *c <= '9'));
    assert_true(opt->min <= opt->max);
    assert_non_null(opt->help);
    assert_true((opt->type == FSDP_OPT_ENUM) == (opt->choices != NULL));
    fsdp_option_id_t id;
    assert_ptr_equal(fsdp_option_find(opt->key, &id), opt);
    assert_int_equal(id, i);
    if (opt->flag) {
      assert_ptr_equal(fsdp_option_find_flag(opt->flag, &id), opt);
      assert_int_equal(id, i);
    }
  }
  assert_null(fsdp_option_get(FSDP_OPTION_COUNT));
  assert_null(fsdp_option_find("daemon.colour", NULL));
  assert_null(fsdp_option_find_flag("--colour", NULL));
  assert_string_equal(fsdp_config_source_name(FSDP_SOURCE_DEFAULT), "default");
  assert_string_equal(fsdp_config_source_name(FSDP_SOURCE_FILE), "file");
  assert_string_equal(fsdp_config_source_name(FSDP_SOURCE_ENV), "env");
  assert_string_equal(fsdp_config_source_name(FSDP_SOURCE_FLAG), "flag");
}

static void test_defaults(void **state) {
  (void)state;
  fsdp_config_t cfg;
  init(&cfg);
  assert_null(cfg.file);
  for (int i = 0; i < FSDP_OPTION_COUNT; i++) {
    const fsdp_option_t *opt = fsdp_option_get((fsdp_option_id_t)i);
    assert_int_equal(cfg.values[i].source, FSDP_SOURCE_DEFAULT);
    assert_string_equal(cfg.values[i].origin, "");
    /* Each default is already in canonical spelling, so it formats back to itself. */
    assert_string_equal(formatted(&cfg, (fsdp_option_id_t)i), opt->default_value);
  }
  assert_string_equal(fsdp_config_text(&cfg, FSDP_OPTION_RUN_DIR), "./run");
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_LOG_LEVEL), 2);
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_HOUSEKEEPING_INTERVAL), 1000);
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_DRAIN_TIMEOUT), 5000);
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_MAX_MESSAGE_SIZE), 16 << 20);
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_MAX_INFLIGHT_CALLS), 1024);
  assert_string_equal(fsdp_config_text(&cfg, FSDP_OPTION_HEALTH_LISTEN), "127.0.0.1:7071");
  /* Derived from the host's memory by fsdp_config_derive. */
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_MEMORY_LIMIT), 0);
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_JOB_MEMORY), 0);
  fsdp_config_cleanup(&cfg);
  /* Cleanup leaves a zeroed config, so a second cleanup is harmless. */
  fsdp_config_cleanup(&cfg);
  fsdp_config_cleanup(NULL);
}

static void test_each_default_parses_through_set(void **state) {
  (void)state;
  for (int i = 0; i < FSDP_OPTION_COUNT; i++) {
    const fsdp_option_t *opt = fsdp_option_get((fsdp_option_id_t)i);
    fsdp_config_t cfg;
    fsdp_status_t st = FSDP_STATUS_INIT;
    init(&cfg);
    assert_int_equal(fsdp_config_set(&cfg, (fsdp_option_id_t)i, opt->default_value,
                                     FSDP_SOURCE_FLAG, "--x", &st), 0);
    assert_string_equal(formatted(&cfg, (fsdp_option_id_t)i), opt->default_value);
    fsdp_config_cleanup(&cfg);
  }
}

static void test_size(void **state) {
  (void)state;
  fsdp_config_t cfg;
  init(&cfg);
  load_ok(&cfg, "[rpc]\nmax_message_size = 4096\n");
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_MAX_MESSAGE_SIZE), 4096);
  assert_string_equal(formatted(&cfg, FSDP_OPTION_MAX_MESSAGE_SIZE), "4KiB");
  fsdp_config_cleanup(&cfg);

  init(&cfg);
  load_ok(&cfg, "[rpc]\nmax_message_size = 1GiB\n[memory]\nlimit = 1TiB\n");
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_MAX_MESSAGE_SIZE), 1 << 30);
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_MEMORY_LIMIT), INT64_C(1) << 40);
  fsdp_config_cleanup(&cfg);

  init(&cfg);
  load_ok(&cfg, "[rpc]\nmax_message_size = 5000B\n");
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_MAX_MESSAGE_SIZE), 5000);
  assert_string_equal(formatted(&cfg, FSDP_OPTION_MAX_MESSAGE_SIZE), "5000B");
  fsdp_config_cleanup(&cfg);

  expect_load_error("[rpc]\n\n# big\n\n\n\nmax_message_size = 2TiB\n",
                    NAME ":7: key 'rpc.max_message_size': value '2TiB' is above the maximum 1GiB");
  expect_load_error("[rpc]\nmax_message_size = 4095\n",
                    NAME ":2: key 'rpc.max_message_size': value '4095' is below the minimum 4KiB");
  expect_load_error("[rpc]\nmax_message_size = 16MB\n",
                    NAME ":2: key 'rpc.max_message_size': value '16MB' has an unknown unit 'MB': "
                         "use B, KiB, MiB, GiB or TiB (binary: 1KiB = 1024B)");
  expect_load_error("[rpc]\nmax_message_size = -1MiB\n",
                    NAME ":2: key 'rpc.max_message_size': value '-1MiB' is negative");
  expect_load_error("[rpc]\nmax_message_size = 1.5GiB\n",
                    NAME ":2: key 'rpc.max_message_size': value '1.5GiB' is not a size: expected "
                         "a whole number of bytes with an optional unit B, KiB, MiB, GiB or TiB, "
                         "e.g. 16MiB");
  expect_load_error("[rpc]\nmax_message_size = 16 MiB\n",
                    NAME ":2: key 'rpc.max_message_size': value '16 MiB' is not a size: expected "
                         "a whole number of bytes with an optional unit B, KiB, MiB, GiB or TiB, "
                         "e.g. 16MiB");
  expect_load_error("[rpc]\nmax_message_size =\n",
                    NAME ":2: key 'rpc.max_message_size': value '' is not a size: expected "
                         "a whole number of bytes with an optional unit B, KiB, MiB, GiB or TiB, "
                         "e.g. 16MiB");
}

static void test_size_overflow_is_an_error(void **state) {
  (void)state;
  /* Digits past 64 bits, and products past 64 bits that would wrap to exactly 1TiB and to 0. */
  expect_load_error("[memory]\nlimit = 99999999999999999999999\n",
                    NAME ":2: key 'memory.limit': value '99999999999999999999999' is above the "
                         "maximum 1TiB");
  expect_load_error("[memory]\nlimit = 16777217TiB\n",
                    NAME ":2: key 'memory.limit': value '16777217TiB' is above the maximum 1TiB");
  expect_load_error("[memory]\nlimit = 17179869184GiB\n",
                    NAME ":2: key 'memory.limit': value '17179869184GiB' is above the maximum "
                         "1TiB");
  expect_load_error("[rpc]\nmax_inflight_calls = 9223372036854775808\n",
                    NAME ":2: key 'rpc.max_inflight_calls': value '9223372036854775808' is above "
                         "the maximum 1000000");
  expect_load_error("[rpc]\nmax_inflight_calls = -9223372036854775809\n",
                    NAME ":2: key 'rpc.max_inflight_calls': value '-9223372036854775809' is below "
                         "the minimum 1");
  expect_load_error("[daemon]\ndrain_timeout = 9223372036854775807h\n",
                    NAME ":2: key 'daemon.drain_timeout': value '9223372036854775807h' is above "
                         "the maximum 10m");
}

static void test_duration(void **state) {
  (void)state;
  fsdp_config_t cfg;
  init(&cfg);
  load_ok(&cfg, "[daemon]\nhousekeeping_interval = 250ms\ndrain_timeout = 2m\n");
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_HOUSEKEEPING_INTERVAL), 250);
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_DRAIN_TIMEOUT), 120000);
  assert_string_equal(formatted(&cfg, FSDP_OPTION_DRAIN_TIMEOUT), "2m");
  fsdp_config_cleanup(&cfg);

  init(&cfg);
  load_ok(&cfg, "[daemon]\ndrain_timeout = 0ms\n");
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_DRAIN_TIMEOUT), 0);
  assert_string_equal(formatted(&cfg, FSDP_OPTION_DRAIN_TIMEOUT), "0s");
  fsdp_config_cleanup(&cfg);

  expect_load_error("[daemon]\ndrain_timeout = 5\n",
                    NAME ":2: key 'daemon.drain_timeout': value '5' needs a unit: ms, s, m or h");
  expect_load_error("[daemon]\ndrain_timeout = 1d\n",
                    NAME ":2: key 'daemon.drain_timeout': value '1d' has an unknown unit 'd': use "
                         "ms, s, m or h");
  expect_load_error("[daemon]\ndrain_timeout = -5s\n",
                    NAME ":2: key 'daemon.drain_timeout': value '-5s' is negative");
  expect_load_error("[daemon]\ndrain_timeout = 1h\n",
                    NAME ":2: key 'daemon.drain_timeout': value '1h' is above the maximum 10m");
  expect_load_error("[daemon]\nhousekeeping_interval = 9ms\n",
                    NAME ":2: key 'daemon.housekeeping_interval': value '9ms' is below the minimum "
                         "10ms");
  expect_load_error("[daemon]\nhousekeeping_interval = 1.5s\n",
                    NAME ":2: key 'daemon.housekeeping_interval': value '1.5s' is not a duration: "
                         "expected a whole number with a unit ms, s, m or h, e.g. 5s");
}

static void test_int(void **state) {
  (void)state;
  fsdp_config_t cfg;
  init(&cfg);
  load_ok(&cfg, "[rpc]\nmax_inflight_calls = 0042\n");
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_MAX_INFLIGHT_CALLS), 42);
  assert_string_equal(formatted(&cfg, FSDP_OPTION_MAX_INFLIGHT_CALLS), "42");
  fsdp_config_cleanup(&cfg);

  expect_load_error("[rpc]\nmax_inflight_calls = 0\n",
                    NAME ":2: key 'rpc.max_inflight_calls': value '0' is below the minimum 1");
  expect_load_error("[rpc]\nmax_inflight_calls = 1000001\n",
                    NAME ":2: key 'rpc.max_inflight_calls': value '1000001' is above the maximum "
                         "1000000");
  expect_load_error("[rpc]\nmax_inflight_calls = 1e3\n",
                    NAME ":2: key 'rpc.max_inflight_calls': value '1e3' is not a whole number");
  expect_load_error("[rpc]\nmax_inflight_calls = +5\n",
                    NAME ":2: key 'rpc.max_inflight_calls': value '+5' is not a whole number");
}

static void test_enum(void **state) {
  (void)state;
  fsdp_config_t cfg;
  init(&cfg);
  load_ok(&cfg, "[daemon]\nlog_level = debug\nbackend = cuda\n");
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_LOG_LEVEL), 3);
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_BACKEND), 1);
  assert_string_equal(formatted(&cfg, FSDP_OPTION_LOG_LEVEL), "debug");
  fsdp_config_cleanup(&cfg);

  expect_load_error("[daemon]\n\n\n\n\n\n\n\nlog_level = loud\n",
                    NAME ":9: key 'daemon.log_level': value 'loud' is not one of "
                         "error|warning|info|debug");
  /* Exact match: no case folding, no prefixes. */
  expect_load_error("[daemon]\nlog_level = INFO\n",
                    NAME ":2: key 'daemon.log_level': value 'INFO' is not one of "
                         "error|warning|info|debug");
  expect_load_error("[daemon]\nlog_level = inf\n",
                    NAME ":2: key 'daemon.log_level': value 'inf' is not one of "
                         "error|warning|info|debug");
}

static void test_address(void **state) {
  (void)state;
  static const char *const good[] = {"[::1]:7071", "0.0.0.0:0", "localhost:65535",
                                     "[fe80::1:2]:80", "my-host.example_1:443", ""};
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    fsdp_config_t cfg;
    fsdp_status_t st = FSDP_STATUS_INIT;
    init(&cfg);
    if (fsdp_config_set(&cfg, FSDP_OPTION_HEALTH_LISTEN, good[i], FSDP_SOURCE_FLAG,
                        "--health-listen", &st) != 0)
      fail_msg("'%s' refused: %s", good[i], st.message);
    assert_string_equal(fsdp_config_text(&cfg, FSDP_OPTION_HEALTH_LISTEN), good[i]);
    assert_string_equal(formatted(&cfg, FSDP_OPTION_HEALTH_LISTEN), good[i]);
    fsdp_config_cleanup(&cfg);
  }

  /* An empty value in the file disables the service too. */
  fsdp_config_t cfg;
  init(&cfg);
  load_ok(&cfg, "[health]\nlisten =\n");
  assert_string_equal(fsdp_config_text(&cfg, FSDP_OPTION_HEALTH_LISTEN), "");
  fsdp_config_cleanup(&cfg);

#define BAD_ADDRESS(value, why)                                                          \
  expect_load_error("[health]\nlisten = " value "\n",                                    \
                    NAME ":2: key 'health.listen': value '" value                         \
                         "' is not HOST:PORT or [IPv6]:PORT: " why)
  BAD_ADDRESS("::1:7071", "an IPv6 host needs brackets, e.g. [::1]:7071");
  BAD_ADDRESS("host:70000", "the port is not a number 0..65535");
  BAD_ADDRESS("host:", "the port is not a number 0..65535");
  BAD_ADDRESS("host:-1", "the port is not a number 0..65535");
  BAD_ADDRESS(":7071", "the host is empty");
  BAD_ADDRESS("host", "no ':PORT'");
  BAD_ADDRESS("[::1]7071", "expected ':PORT' after the closing ']'");
  BAD_ADDRESS("[::1:7071", "expected ':PORT' after the closing ']'");
  BAD_ADDRESS("[]:7071", "the IPv6 host is empty or too long");
  BAD_ADDRESS("[zz]:7071", "'zz' is not an IPv6 address");
  BAD_ADDRESS("a b:1", "the host may hold only letters, digits, '.', '-' and '_'");
#undef BAD_ADDRESS
}

static void test_path(void **state) {
  (void)state;
  fsdp_config_t cfg;
  init(&cfg);
  load_ok(&cfg, "[daemon]\nrun_dir = /var/run/fsdpd  \n");
  /* inih trims the file's values. */
  assert_string_equal(fsdp_config_text(&cfg, FSDP_OPTION_RUN_DIR), "/var/run/fsdpd");
  fsdp_config_cleanup(&cfg);
  expect_load_error("[daemon]\nrun_dir =   \n",
                    NAME ":2: key 'daemon.run_dir': value '' is empty: a path is required");
}

/* BOOL and STRING have no option in the table yet; check their syntax directly. */
static void test_bool_and_string_values(void **state) {
  (void)state;
  const fsdp_option_t flag = {"x.flag", FSDP_OPT_BOOL, "false", 0, 0, NULL, NULL, true, NULL, ""};
  const fsdp_option_t text = {"x.text", FSDP_OPT_STRING, "", 0, 0, NULL, NULL, true, NULL, ""};
  static const char *const truths[] = {"true", "yes", "on", "1"};
  static const char *const lies[] = {"false", "no", "off", "0"};
  char why[256], buf[16];
  int64_t v;
  for (int i = 0; i < 4; i++) {
    assert_int_equal(fsdp_config_value_parse(&flag, truths[i], &v, why, sizeof why), 0);
    assert_int_equal(v, 1);
    assert_int_equal(fsdp_config_value_parse(&flag, lies[i], &v, why, sizeof why), 0);
    assert_int_equal(v, 0);
  }
  assert_int_equal(fsdp_config_value_format(&flag, 1, buf, sizeof buf), 4);
  assert_string_equal(buf, "true");
  assert_int_equal(fsdp_config_value_format(&flag, 0, buf, sizeof buf), 5);
  assert_string_equal(buf, "false");
  v = 7;
  assert_int_equal(fsdp_config_value_parse(&flag, "True", &v, why, sizeof why), FSDP_E_CONFIG);
  assert_string_equal(why, "value 'True' is not a boolean: use true|false, yes|no, on|off or 1|0");
  assert_int_equal(v, 7);
  assert_int_equal(fsdp_config_value_parse(&text, "", &v, why, sizeof why), 0);
  assert_int_equal(fsdp_config_value_parse(&text, " any thing ", &v, why, sizeof why), 0);
  /* A text type has no number to spell. */
  assert_int_equal(fsdp_config_value_format(&text, 0, buf, sizeof buf), -EINVAL);
}

static void test_long_values_are_cut_in_messages(void **state) {
  (void)state;
  char value[300], message[512];
  memset(value, 'x', sizeof value - 1);
  value[sizeof value - 1] = '\0';
  fsdp_config_t cfg;
  fsdp_status_t st = FSDP_STATUS_INIT;
  init(&cfg);
  assert_int_equal(fsdp_config_set(&cfg, FSDP_OPTION_LOG_LEVEL, value, FSDP_SOURCE_FLAG,
                                   "--log-level", &st), FSDP_E_CONFIG);
  snprintf(message, sizeof message,
           "--log-level: key 'daemon.log_level': value '%.64s...' is not one of "
           "error|warning|info|debug", value);
  assert_string_equal(st.message, message);
  fsdp_config_cleanup(&cfg);
}

static void test_unknown_keys_and_sections(void **state) {
  (void)state;
  expect_load_error("# c\n[daemon]\ncolour = red\n",
                    NAME ":3: unknown key 'daemon.colour'; known keys in [daemon]: run_dir, "
                         "log_level, backend, cuda_device, housekeeping_interval, drain_timeout, "
                         "operator_group");
  expect_load_error("[daemon]\nlog_level = info\n[colours]\nred = 1\n",
                    NAME ":4: key 'colours.red': unknown section [colours]; known sections: "
                         "[daemon], [rpc], [health], [metrics], [trace], [memory], [store], "
                         "[checkpoint], [session], [cluster], [peer]");
  expect_load_error("log_level = info\n",
                    NAME ":1: key 'log_level' is outside any section; it belongs under [daemon]");
  expect_load_error("\ncolour = red\n",
                    NAME ":2: key 'colour' is outside any section; known sections: [daemon], "
                         "[rpc], [health], [metrics], [trace], [memory], [store], [checkpoint], "
                         "[session], [cluster], [peer]");
  /* Names are case-sensitive. */
  expect_load_error("[DAEMON]\nlog_level = info\n",
                    NAME ":2: key 'DAEMON.log_level': unknown section [DAEMON]; known sections: "
                         "[daemon], [rpc], [health], [metrics], [trace], [memory], [store], "
                         "[checkpoint], [session], [cluster], [peer]");
}

static void test_duplicate_key(void **state) {
  (void)state;
  expect_load_error("[daemon]\nlog_level = info\n\n# again\nlog_level = debug\n",
                    NAME ":5: key 'daemon.log_level' already set at line 2");
  /* Also when the section is opened twice. */
  expect_load_error("[daemon]\nlog_level = info\n[rpc]\nmax_inflight_calls = 1\n[daemon]\n"
                    "log_level = info\n",
                    NAME ":6: key 'daemon.log_level' already set at line 2");
  /* An indented line is an ordinary line, not a continuation of the previous value. */
  expect_load_error("[daemon]\nlog_level = info\n  log_level = debug\n",
                    NAME ":3: key 'daemon.log_level' already set at line 2");
  fsdp_config_t cfg;
  init(&cfg);
  load_ok(&cfg, "[daemon]\nlog_level = info\n    backend = cuda\n");
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_BACKEND), 1);
  assert_string_equal(cfg.values[FSDP_OPTION_BACKEND].origin, NAME ":3");
  fsdp_config_cleanup(&cfg);
}

static void test_syntax_errors(void **state) {
  (void)state;
  expect_load_error("[daemon]\nlog_level = info\nrun_dir /tmp\n",
                    NAME ":3: 'run_dir /tmp' is not 'name = value', '[section]' or a comment");
  expect_load_error("\n[daemon\nlog_level = info\n",
                    NAME ":2: section header '[daemon' has no closing ']'");
  /* The first bad line is reported, whichever kind of error it has. */
  expect_load_error("[daemon]\nnonsense\nlog_level = loud\n",
                    NAME ":2: 'nonsense' is not 'name = value', '[section]' or a comment");
  expect_load_error("[daemon]\nlog_level = loud\nnonsense\n",
                    NAME ":2: key 'daemon.log_level': value 'loud' is not one of "
                         "error|warning|info|debug");
  char text[400], message[128];
  memset(text, 0, sizeof text);
  strcpy(text, "[daemon]\n# ");
  memset(text + strlen(text), 'x', 250);
  strcat(text, " log_level = loud\n");
  snprintf(message, sizeof message, NAME ":2: line is longer than %d characters", 197);
  expect_load_error(text, message);
}

static void test_line_numbers_with_crlf_bom_and_comments(void **state) {
  (void)state;
  expect_load_error("\xEF\xBB\xBF; comment\r\n[daemon]\r\n\r\n# x = y\r\nlog_level = info ; ok\r\n"
                    "backend = tpu\r\n",
                    NAME ":6: key 'daemon.backend': value 'tpu' is not one of host|cuda");
  fsdp_config_t cfg;
  init(&cfg);
  load_ok(&cfg, "\xEF\xBB\xBF[daemon]\r\nlog_level = debug ; inline comment\r\n");
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_LOG_LEVEL), 3);
  assert_string_equal(cfg.values[FSDP_OPTION_LOG_LEVEL].origin, NAME ":2");
  fsdp_config_cleanup(&cfg);
  /* No final newline, and an empty text. */
  init(&cfg);
  load_ok(&cfg, "[daemon]\nlog_level = error");
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_LOG_LEVEL), 0);
  load_ok(&cfg, "");
  fsdp_config_cleanup(&cfg);
}

static void test_precedence(void **state) {
  (void)state;
  fsdp_config_t cfg;
  fsdp_status_t st = FSDP_STATUS_INIT;
  init(&cfg);
  load_ok(&cfg, "[daemon]\nlog_level = debug\nbackend = cuda\n[rpc]\nmax_inflight_calls = 10\n");
  char *env[] = {"PATH=/usr/bin",
                 "FSDPD_SOCKET=/run/fsdpd/fsdpd.sock",
                 "FSDPD_JOB=train-7",
                 "FSDPD_DAEMON_LOG_LEVEL=error",
                 "FSDPD_DAEMON_BACKEND=host",
                 "FSDPD_HEALTH_LISTEN=[::]:9000",
                 "FSDPD_NO_EQUALS_SIGN",
                 "FSDPD_DAEMON_LOG_LEVEL=debug",
                 NULL};
  assert_int_equal(fsdp_config_load_env(&cfg, env, &st), 0);
  assert_int_equal(fsdp_config_set(&cfg, FSDP_OPTION_LOG_LEVEL, "warning", FSDP_SOURCE_FLAG,
                                   "--log-level", &st), 0);

  const fsdp_config_value_t *v = cfg.values;
  assert_int_equal(v[FSDP_OPTION_LOG_LEVEL].number, 1);
  assert_int_equal(v[FSDP_OPTION_LOG_LEVEL].source, FSDP_SOURCE_FLAG);
  assert_string_equal(v[FSDP_OPTION_LOG_LEVEL].origin, "--log-level");
  /* The environment beats the file; the first of two equal variables wins, like getenv(). */
  assert_int_equal(v[FSDP_OPTION_BACKEND].number, 0);
  assert_int_equal(v[FSDP_OPTION_BACKEND].source, FSDP_SOURCE_ENV);
  assert_string_equal(v[FSDP_OPTION_BACKEND].origin, "FSDPD_DAEMON_BACKEND");
  assert_string_equal(v[FSDP_OPTION_HEALTH_LISTEN].text, "[::]:9000");
  assert_int_equal(v[FSDP_OPTION_HEALTH_LISTEN].source, FSDP_SOURCE_ENV);
  assert_int_equal(v[FSDP_OPTION_MAX_INFLIGHT_CALLS].number, 10);
  assert_int_equal(v[FSDP_OPTION_MAX_INFLIGHT_CALLS].source, FSDP_SOURCE_FILE);
  assert_string_equal(v[FSDP_OPTION_MAX_INFLIGHT_CALLS].origin, NAME ":5");
  assert_int_equal(v[FSDP_OPTION_RUN_DIR].source, FSDP_SOURCE_DEFAULT);
  assert_string_equal(v[FSDP_OPTION_RUN_DIR].origin, "");
  fsdp_config_cleanup(&cfg);
}

static void test_env_and_flag_errors(void **state) {
  (void)state;
  fsdp_config_t cfg;
  fsdp_status_t st = FSDP_STATUS_INIT;
  init(&cfg);
  char *env[] = {"FSDPD_RPC_MAX_MESSAGE_SIZE=2TiB", NULL};
  assert_int_equal(fsdp_config_load_env(&cfg, env, &st), FSDP_E_CONFIG);
  assert_string_equal(st.message, "environment FSDPD_RPC_MAX_MESSAGE_SIZE: key "
                                  "'rpc.max_message_size': value '2TiB' is above the maximum 1GiB");
  /* The environment is taken verbatim: no trimming. */
  char *spaced[] = {"FSDPD_DAEMON_LOG_LEVEL= debug", NULL};
  assert_int_equal(fsdp_config_load_env(&cfg, spaced, &st), FSDP_E_CONFIG);
  assert_string_equal(st.message, "environment FSDPD_DAEMON_LOG_LEVEL: key 'daemon.log_level': "
                                  "value ' debug' is not one of error|warning|info|debug");
  char *empty_path[] = {"FSDPD_DAEMON_RUN_DIR=", NULL};
  assert_int_equal(fsdp_config_load_env(&cfg, empty_path, &st), FSDP_E_CONFIG);
  assert_string_equal(st.message, "environment FSDPD_DAEMON_RUN_DIR: key 'daemon.run_dir': "
                                  "value '' is empty: a path is required");

  assert_int_equal(fsdp_config_set(&cfg, FSDP_OPTION_LOG_LEVEL, "loud", FSDP_SOURCE_FLAG,
                                   "--log-level", &st), FSDP_E_CONFIG);
  assert_string_equal(st.message, "--log-level: key 'daemon.log_level': value 'loud' is not one "
                                  "of error|warning|info|debug");
  assert_int_equal(fsdp_config_set(&cfg, FSDP_OPTION_DRAIN_TIMEOUT, "5", FSDP_SOURCE_FLAG,
                                   "--set daemon.drain_timeout", &st), FSDP_E_CONFIG);
  assert_string_equal(st.message, "--set daemon.drain_timeout: key 'daemon.drain_timeout': value "
                                  "'5' needs a unit: ms, s, m or h");
  /* A failed set leaves the value as it was. */
  assert_int_equal(cfg.values[FSDP_OPTION_LOG_LEVEL].number, 2);
  assert_int_equal(cfg.values[FSDP_OPTION_LOG_LEVEL].source, FSDP_SOURCE_DEFAULT);
  assert_int_equal(fsdp_config_set(&cfg, FSDP_OPTION_COUNT, "x", FSDP_SOURCE_FLAG, "--x", &st),
                   FSDP_E_INVALID_ARGUMENT);
  fsdp_config_cleanup(&cfg);
}

static void test_load_file(void **state) {
  (void)state;
  fsdp_config_t cfg;
  fsdp_status_t st = FSDP_STATUS_INIT;
  init(&cfg);
  assert_int_equal(fsdp_config_load_file(&cfg, "/nonexistent/fsdpd.conf", &st), FSDP_E_CONFIG);
  assert_string_equal(st.message,
                      "cannot read config file '/nonexistent/fsdpd.conf': No such file or directory");
  assert_int_equal(fsdp_config_load_file(&cfg, "/", &st), FSDP_E_CONFIG);
  assert_string_equal(st.message, "cannot read config file '/': Is a directory");
  assert_null(cfg.file);

  char path[] = "/tmp/test_config_XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  const char text[] = "[memory]\nlimit = 64MiB\n[daemon]\nlog_level = debug\n";
  assert_int_equal(write(fd, text, sizeof text - 1), (ssize_t)(sizeof text - 1));
  close(fd);
  assert_int_equal(fsdp_config_load_file(&cfg, path, &st), 0);
  assert_string_equal(cfg.file, path);
  assert_int_equal(fsdp_config_number(&cfg, FSDP_OPTION_MEMORY_LIMIT), 64 << 20);
  char origin[64];
  snprintf(origin, sizeof origin, "%s:4", path);
  assert_string_equal(cfg.values[FSDP_OPTION_LOG_LEVEL].origin, origin);
  fsdp_config_cleanup(&cfg);

  /* A file with a NUL byte is not text. */
  fd = open(path, O_WRONLY | O_TRUNC);
  assert_true(fd >= 0);
  assert_int_equal(write(fd, "[daemon]\nlog_level = in\0fo\n", 27), 27);
  close(fd);
  init(&cfg);
  assert_int_equal(fsdp_config_load_file(&cfg, path, &st), FSDP_E_CONFIG);
  char message[128];
  snprintf(message, sizeof message, "%s:2: line holds a NUL byte; expected text", path);
  assert_string_equal(st.message, message);
  assert_null(cfg.file);
  fsdp_config_cleanup(&cfg);
  unlink(path);
}

static void test_long_path_keeps_line_in_origin(void **state) {
  (void)state;
  char name[200];
  memset(name, 'd', sizeof name - 1);
  name[sizeof name - 1] = '\0';
  fsdp_config_t cfg;
  fsdp_status_t st = FSDP_STATUS_INIT;
  init(&cfg);
  assert_int_equal(fsdp_config_load_string(&cfg, "[daemon]\nlog_level = debug\n", name, &st), 0);
  const char *origin = cfg.values[FSDP_OPTION_LOG_LEVEL].origin;
  assert_int_equal(strlen(origin), sizeof cfg.values[0].origin - 1);
  assert_memory_equal(origin, "...", 3);
  assert_string_equal(origin + strlen(origin) - 2, ":2");
  fsdp_config_cleanup(&cfg);
}

static void test_format_round_trips(void **state) {
  (void)state;
  static const struct {
    fsdp_option_id_t id;
    const char *in, *out;
  } cases[] = {
      {FSDP_OPTION_MAX_MESSAGE_SIZE, "16777216", "16MiB"},
      {FSDP_OPTION_MAX_MESSAGE_SIZE, "1024KiB", "1MiB"},
      {FSDP_OPTION_MAX_MESSAGE_SIZE, "1536KiB", "1536KiB"},
      {FSDP_OPTION_MAX_MESSAGE_SIZE, "4097B", "4097B"},
      {FSDP_OPTION_MEMORY_LIMIT, "1048576MiB", "1TiB"},
      {FSDP_OPTION_MEMORY_LIMIT, "3072MiB", "3GiB"},
      {FSDP_OPTION_DRAIN_TIMEOUT, "5000ms", "5s"},
      {FSDP_OPTION_DRAIN_TIMEOUT, "1500ms", "1500ms"},
      {FSDP_OPTION_DRAIN_TIMEOUT, "120s", "2m"},
      {FSDP_OPTION_DRAIN_TIMEOUT, "90s", "90s"},
      {FSDP_OPTION_DRAIN_TIMEOUT, "0s", "0s"},
      {FSDP_OPTION_HOUSEKEEPING_INTERVAL, "1m", "1m"},
      {FSDP_OPTION_BACKEND, "cuda", "cuda"},
      {FSDP_OPTION_MAX_INFLIGHT_CALLS, "000100", "100"},
      {FSDP_OPTION_RUN_DIR, "/run/fsdpd", "/run/fsdpd"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    fsdp_config_t cfg;
    fsdp_status_t st = FSDP_STATUS_INIT;
    init(&cfg);
    if (fsdp_config_set(&cfg, cases[i].id, cases[i].in, FSDP_SOURCE_FLAG, "--x", &st) != 0)
      fail_msg("'%s' refused: %s", cases[i].in, st.message);
    int64_t number = fsdp_config_number(&cfg, cases[i].id);
    char out[64];
    assert_int_equal(fsdp_config_format(&cfg, cases[i].id, out, sizeof out),
                     (int)strlen(cases[i].out));
    assert_string_equal(out, cases[i].out);
    /* The canonical spelling parses back to the same value. */
    assert_int_equal(fsdp_config_set(&cfg, cases[i].id, out, FSDP_SOURCE_FLAG, "--x", &st), 0);
    assert_int_equal(fsdp_config_number(&cfg, cases[i].id), number);
    fsdp_config_cleanup(&cfg);
  }
  fsdp_config_t cfg;
  char tiny[4];
  init(&cfg);
  assert_int_equal(fsdp_config_format(&cfg, FSDP_OPTION_MAX_MESSAGE_SIZE, tiny, sizeof tiny),
                   -ENOSPC);
  assert_int_equal(fsdp_config_format(&cfg, FSDP_OPTION_RUN_DIR, tiny, sizeof tiny), -ENOSPC);
  assert_int_equal(fsdp_config_format(&cfg, FSDP_OPTION_COUNT, tiny, sizeof tiny), -EINVAL);
  fsdp_config_cleanup(&cfg);
}

static void test_diff(void **state) {
  (void)state;
  fsdp_config_t a, b;
  fsdp_status_t st = FSDP_STATUS_INIT;
  fsdp_option_id_t ids[FSDP_OPTION_COUNT];
  init(&a);
  init(&b);
  assert_int_equal(fsdp_config_diff(&a, &b, ids), 0);
  /* The same value from another source, in another spelling, is no change. */
  assert_int_equal(fsdp_config_set(&b, FSDP_OPTION_DRAIN_TIMEOUT, "5000ms", FSDP_SOURCE_ENV,
                                   "FSDPD_DAEMON_DRAIN_TIMEOUT", &st), 0);
  assert_int_equal(fsdp_config_set(&b, FSDP_OPTION_RUN_DIR, "./run", FSDP_SOURCE_FLAG,
                                   "--run-dir", &st), 0);
  assert_int_equal(fsdp_config_diff(&a, &b, ids), 0);
  assert_int_equal(fsdp_config_set(&b, FSDP_OPTION_LOG_LEVEL, "debug", FSDP_SOURCE_FLAG,
                                   "--log-level", &st), 0);
  assert_int_equal(fsdp_config_set(&b, FSDP_OPTION_HEALTH_LISTEN, "127.0.0.1:7072",
                                   FSDP_SOURCE_FLAG, "--health-listen", &st), 0);
  assert_int_equal(fsdp_config_diff(&a, &b, ids), 2);
  assert_int_equal(ids[0], FSDP_OPTION_LOG_LEVEL);
  assert_int_equal(ids[1], FSDP_OPTION_HEALTH_LISTEN);
  assert_int_equal(fsdp_config_diff(&b, &a, NULL), 2);
  fsdp_config_cleanup(&a);
  fsdp_config_cleanup(&b);
}

static char *example_text(size_t *ret_size) {
  char *text = NULL;
  size_t size = 0;
  FILE *out = open_memstream(&text, &size);
  assert_non_null(out);
  fsdp_config_write_example(out);
  assert_int_equal(fclose(out), 0);
  *ret_size = size;
  return text;
}

static void test_shipped_example_matches_table(void **state) {
  (void)state;
  const char *source_dir = getenv("FSDP_SOURCE_DIR");
  if (!source_dir)
    fail_msg("FSDP_SOURCE_DIR is not set; run this test through ctest");
  char path[4096];
  snprintf(path, sizeof path, "%s/config/fsdpd.conf", source_dir);
  FILE *f = fopen(path, "rb");
  if (!f)
    fail_msg("cannot open %s", path);
  static char shipped[1 << 16];
  size_t shipped_size = fread(shipped, 1, sizeof shipped, f);
  fclose(f);

  size_t size;
  char *text = example_text(&size);
  size_t same = 0;
  while (same < size && same < shipped_size && text[same] == shipped[same])
    same++;
  if (same != size || size != shipped_size) {
    unsigned line = 1;
    for (size_t i = 0; i < same; i++)
      line += text[i] == '\n';
    free(text);
    fail_msg("%s differs from fsdp_config_write_example() at line %u: the option table and the "
             "shipped file must change together. Regenerate the file from the table with "
             "build/bin/test_config --write-example > config/fsdpd.conf",
             path, line);
  }
  free(text);
}

static void test_example_loads_to_defaults(void **state) {
  (void)state;
  size_t size;
  char *text = example_text(&size);
  fsdp_config_t cfg, defaults;
  init(&cfg);
  init(&defaults);
  load_ok(&cfg, text);
  fsdp_option_id_t ids[FSDP_OPTION_COUNT];
  assert_int_equal(fsdp_config_diff(&defaults, &cfg, ids), 0);
  fsdp_config_cleanup(&cfg);

  /* Uncommented, every option line is valid and sets the default from the file. */
  unsigned uncommented = 0;
  for (char *line = text; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
    if (line[0] == '#' && line[1] >= 'a' && line[1] <= 'z') {
      line[0] = ' ';
      uncommented++;
    }
  }
  assert_int_equal(uncommented, FSDP_OPTION_COUNT);
  init(&cfg);
  load_ok(&cfg, text);
  assert_int_equal(fsdp_config_diff(&defaults, &cfg, ids), 0);
  for (int i = 0; i < FSDP_OPTION_COUNT; i++)
    assert_int_equal(cfg.values[i].source, FSDP_SOURCE_FILE);
  fsdp_config_cleanup(&cfg);
  fsdp_config_cleanup(&defaults);
  free(text);
}


/* Loads text and runs the cross-option check; returns its code, the message in st. */
static int check_text(const char *text, fsdp_status_t *st) {
  fsdp_config_t cfg;
  init(&cfg);
  load_ok(&cfg, text);
  int r = fsdp_config_check(&cfg, st);
  fsdp_config_cleanup(&cfg);
  return r;
}

static void expect_check_error(const char *text, const char *message) {
  fsdp_status_t st = FSDP_STATUS_INIT;
  assert_int_equal(check_text(text, &st), FSDP_E_CONFIG);
  assert_string_equal(st.message, message);
}

static void expect_check_ok(const char *text) {
  fsdp_status_t st = FSDP_STATUS_INIT;
  if (check_text(text, &st) != 0)
    fail_msg("check of %s failed: %s", text, st.message);
}

static void test_host_list_values(void **state) {
  (void)state;
  fsdp_config_t cfg;
  char buf[64];
  init(&cfg);
  assert_int_equal(fsdp_config_host_count(&cfg), 0);
  assert_int_equal(fsdp_config_host(&cfg, 0, buf, sizeof buf), -ENOENT);
  load_ok(&cfg, "[cluster]\nhosts = 10.0.0.1:7000, host-b:7000,[::1]:7001\n");
  assert_int_equal(fsdp_config_host_count(&cfg), 3);
  assert_int_equal(fsdp_config_host(&cfg, 1, buf, sizeof buf), 11);
  assert_string_equal(buf, "host-b:7000");
  assert_int_equal(fsdp_config_host(&cfg, 2, buf, sizeof buf), 10);
  assert_string_equal(buf, "[::1]:7001");
  assert_int_equal(fsdp_config_host(&cfg, 3, buf, sizeof buf), -ENOENT);
  assert_int_equal(fsdp_config_host(&cfg, 0, buf, 4), -ENOSPC);
  assert_int_equal(fsdp_address_port("[::1]:7001"), 7001);
  assert_int_equal(fsdp_address_port("a:"), -1);
  assert_int_equal(fsdp_address_port("a:99999"), -1);
  fsdp_config_cleanup(&cfg);

  expect_load_error("[cluster]\nhosts = a:1,,b:2\n",
                    NAME ":2: key 'cluster.hosts': address 1 is empty (value 'a:1,,b:2')");
  expect_load_error("[cluster]\nhosts = a:1,b\n",
                    NAME ":2: key 'cluster.hosts': address 1: value 'b' is not HOST:PORT or "
                         "[IPv6]:PORT: no ':PORT'");
  expect_load_error("[cluster]\nhosts = a:1,b:0\n",
                    NAME ":2: key 'cluster.hosts': address 1 'b:0': port 0, expected 1..65535");
  expect_load_error("[cluster]\nhosts = a:1,b:2, a:1\n",
                    NAME ":2: key 'cluster.hosts': address 2 'a:1' repeats address 0: hosts "
                         "are distinct");
}

static void test_cluster_check(void **state) {
  (void)state;
  /* One host, as before any cluster option existed. */
  expect_check_ok("");
  expect_check_ok("[cluster]\nhosts = 127.0.0.1:7100\n");
  expect_check_ok("[cluster]\nhosts = a:7100,b:7100\nhost_rank = 1\nlocal_world_size = 2\n"
                  "shard_group_hosts = 2\n[peer]\nlisten = 0.0.0.0:7100\ninsecure = true\n");
  /* Several hosts peer with a token, mutual TLS, or peer.insecure set on purpose. */
  expect_check_error("[cluster]\nhosts = a:7100,b:7100\nlocal_world_size = 2\n",
                     "peering 2 hosts needs a token (key 'peer.token_file') or mutual TLS "
                     "(keys 'peer.tls_cert', 'peer.tls_key', 'peer.tls_ca'); set key "
                     "'peer.insecure' = true to peer without either on purpose");
  expect_check_ok("[cluster]\nhosts = a:7100,b:7100\nlocal_world_size = 2\n"
                  "[peer]\ntoken_file = t\n");
  expect_check_ok("[cluster]\nhosts = a:7100,b:7100\nlocal_world_size = 2\n"
                  "[peer]\ntls_cert = c.pem\ntls_key = k.pem\ntls_ca = ca.pem\n");
  expect_check_error("[cluster]\nhost_rank = 1\n",
                     "key 'cluster.host_rank': value 1 (from " NAME ":2) is not below the "
                     "number of hosts, 0 in cluster.hosts (empty: one host, rank 0)");
  expect_check_error("[cluster]\nhosts = a:1,b:1\nhost_rank = 2\nlocal_world_size = 1\n",
                     "key 'cluster.host_rank': value 2 (from " NAME ":3) is not below the "
                     "number of hosts, 2 in cluster.hosts");
  expect_check_error("[cluster]\nhosts = a:1,b:1,c:1\nshard_group_hosts = 2\n"
                     "local_world_size = 1\n",
                     "key 'cluster.shard_group_hosts': value 2 (from " NAME ":3) does not "
                     "divide the number of hosts, 3: a shard group is whole hosts, S divides N");
  expect_check_error("[cluster]\nhosts = a:1,b:1\n",
                     "key 'cluster.local_world_size' is required with 2 hosts in "
                     "cluster.hosts: set it to the number of trainers per host");
  expect_check_error("[cluster]\nhosts = a:7100,b:7200\nhost_rank = 1\nlocal_world_size = 2\n"
                     "[peer]\nlisten = 0.0.0.0:7100\n",
                     "key 'peer.listen': value '0.0.0.0:7100' (from " NAME ":6) has another "
                     "port than this host's entry cluster.hosts[1] = 'b:7200'; the ports must "
                     "be equal");
  expect_check_error("[peer]\ntls_cert = c.pem\n",
                     "peer TLS is all or none: peer.tls_cert is set but peer.tls_key, "
                     "peer.tls_ca are empty");
  expect_check_error("[peer]\ntls_cert = c.pem\ntls_ca = ca.pem\n",
                     "peer TLS is all or none: peer.tls_cert, peer.tls_ca are set but "
                     "peer.tls_key is empty");
  expect_check_ok("[peer]\ntls_cert = c.pem\ntls_key = k.pem\ntls_ca = ca.pem\n");
}

/* Loads text, derives with host_memory and returns memory.limit and memory.job_limit, and
 * the origin of memory.job_limit. */
static void derived(const char *text, uint64_t host_memory, int64_t *ret_limit,
                    int64_t *ret_job, char *ret_origin, size_t size) {
  fsdp_config_t cfg;
  fsdp_status_t st = FSDP_STATUS_INIT;
  init(&cfg);
  load_ok(&cfg, text);
  assert_int_equal(fsdp_config_derive(&cfg, host_memory, &st), 0);
  *ret_limit = fsdp_config_number(&cfg, FSDP_OPTION_MEMORY_LIMIT);
  *ret_job = fsdp_config_number(&cfg, FSDP_OPTION_JOB_MEMORY);
  snprintf(ret_origin, size, "%s", cfg.values[FSDP_OPTION_JOB_MEMORY].origin);
  fsdp_config_cleanup(&cfg);
}

/* Issue 29 item 3: memory.job_limit was 1GiB whatever the host, refusing a model of 130 M
 * fp32 parameters; both memory sizes now follow the host's memory unless set. */
static void test_memory_sizes_derive_from_the_host(void **state) {
  (void)state;
  const int64_t gib = INT64_C(1) << 30, mib = INT64_C(1) << 20;
  int64_t limit, job;
  char origin[96];
  derived("", (uint64_t)24 * gib, &limit, &job, origin, sizeof origin);
  assert_int_equal(limit, 12 * gib);
  assert_int_equal(job, 3 * gib);
  assert_string_equal(origin, "a quarter of memory.limit");
  /* Whole 2 MiB pages, rounded down. */
  derived("", (uint64_t)(1000 * mib + 12345), &limit, &job, origin, sizeof origin);
  assert_int_equal(limit, 500 * mib);
  assert_int_equal(job, 124 * mib);
  /* A small host still gets the least sizes. */
  derived("", (uint64_t)(32 * mib), &limit, &job, origin, sizeof origin);
  assert_int_equal(limit, 64 * mib);
  assert_int_equal(job, 64 * mib);
  /* A limit that is set sizes the arenas; arenas that are set stay. */
  derived("[memory]\nlimit = 8GiB\n", (uint64_t)512 * gib, &limit, &job, origin, sizeof origin);
  assert_int_equal(limit, 8 * gib);
  assert_int_equal(job, 2 * gib);
  derived("[memory]\njob_limit = 1GiB\n", (uint64_t)24 * gib, &limit, &job, origin,
          sizeof origin);
  assert_int_equal(limit, 12 * gib);
  assert_int_equal(job, gib);
  /* A GPU's arenas are not the host's memory. */
  derived("[daemon]\nbackend = cuda\n", (uint64_t)512 * gib, &limit, &job, origin,
          sizeof origin);
  assert_int_equal(job, gib);
  assert_string_equal(origin, "1GiB with backend cuda");

  /* A reload that changes memory.limit keeps the arenas' size the daemon started with,
   * which cannot change without a restart. */
  fsdp_config_t running, next;
  fsdp_status_t st = FSDP_STATUS_INIT;
  init(&running);
  assert_int_equal(fsdp_config_derive(&running, (uint64_t)24 * gib, &st), 0);
  init(&next);
  load_ok(&next, "[memory]\nlimit = 1GiB\n");
  assert_int_equal(fsdp_config_derive(&next, (uint64_t)24 * gib, &st), 0);
  fsdp_config_keep_derived(&next, &running);
  assert_int_equal(fsdp_config_number(&next, FSDP_OPTION_MEMORY_LIMIT), gib);
  assert_int_equal(fsdp_config_number(&next, FSDP_OPTION_JOB_MEMORY), 3 * gib);
  fsdp_option_id_t ids[FSDP_OPTION_COUNT];
  assert_int_equal(fsdp_config_diff(&running, &next, ids), 1);
  assert_int_equal(ids[0], FSDP_OPTION_MEMORY_LIMIT);
  fsdp_config_cleanup(&running);
  fsdp_config_cleanup(&next);

  fsdp_config_t cfg;
  init(&cfg);
  load_ok(&cfg, "[memory]\njob_limit = 1MiB\n");
  assert_int_equal(fsdp_config_derive(&cfg, (uint64_t)24 * gib, &st), FSDP_E_CONFIG);
  assert_string_equal(st.message, "key 'memory.job_limit': value 1048576 bytes (from fsdpd.conf:2) "
                                  "is below 64MiB; 0 derives it from the host's memory");
  fsdp_config_cleanup(&cfg);
}

int main(int argc, char **argv) {
  if (argc == 2 && strcmp(argv[1], "--write-example") == 0) {
    fsdp_config_write_example(stdout);
    return fflush(stdout) == 0 ? 0 : 1;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_table_is_well_formed),
      cmocka_unit_test(test_defaults),
      cmocka_unit_test(test_each_default_parses_through_set),
      cmocka_unit_test(test_size),
      cmocka_unit_test(test_size_overflow_is_an_error),
      cmocka_unit_test(test_duration),
      cmocka_unit_test(test_int),
      cmocka_unit_test(test_enum),
      cmocka_unit_test(test_address),
      cmocka_unit_test(test_path),
      cmocka_unit_test(test_bool_and_string_values),
      cmocka_unit_test(test_long_values_are_cut_in_messages),
      cmocka_unit_test(test_unknown_keys_and_sections),
      cmocka_unit_test(test_duplicate_key),
      cmocka_unit_test(test_syntax_errors),
      cmocka_unit_test(test_line_numbers_with_crlf_bom_and_comments),
      cmocka_unit_test(test_precedence),
      cmocka_unit_test(test_env_and_flag_errors),
      cmocka_unit_test(test_load_file),
      cmocka_unit_test(test_long_path_keeps_line_in_origin),
      cmocka_unit_test(test_format_round_trips),
      cmocka_unit_test(test_diff),
      cmocka_unit_test(test_shipped_example_matches_table),
      cmocka_unit_test(test_example_loads_to_defaults),
      cmocka_unit_test(test_host_list_values),
      cmocka_unit_test(test_cluster_check),
      cmocka_unit_test(test_memory_sizes_derive_from_the_host),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
