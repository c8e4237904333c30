/* Value syntax of config options: parsing with range checks, and the canonical spelling.
 * Numbers are read digit by digit with overflow checks, never through strtoll and a wrap, so
 * that "99999999999TiB" is refused as too large instead of becoming a small number. */
#include "config/config_value.h"

#include <arpa/inet.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include <fsdp/fsdp_error.h>

typedef struct unit {
  const char *name;
  int64_t factor;
} unit_t;

/* Largest first: formatting picks the first unit that divides the value exactly. Decimal
 * units (KB, MB) are deliberately absent; see the example file's header. */
static const unit_t size_units[] = {
    {"TiB", INT64_C(1) << 40}, {"GiB", INT64_C(1) << 30}, {"MiB", INT64_C(1) << 20},
    {"KiB", INT64_C(1) << 10}, {"B", 1},
};
static const unit_t duration_units[] = {
    {"h", INT64_C(3600000)}, {"m", INT64_C(60000)}, {"s", INT64_C(1000)}, {"ms", 1},
};
#define N_UNITS(a) (sizeof(a) / sizeof((a)[0]))

/* The value as quoted in messages, cut so that the expectation after it still fits in the
 * status message (an environment variable can be arbitrarily long). */
#define ECHO_MAX 64
#define ECHO_FMT "'%.*s%s'"
#define ECHO_ARG(t) (int)(strlen(t) > ECHO_MAX ? ECHO_MAX : strlen(t)), (t), (strlen(t) > ECHO_MAX ? "..." : "")

static bool is_digit(char c) {
  return c >= '0' && c <= '9';
}

static bool is_alpha(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

/* Reads the decimal digits at s (at least one must be there). Sets *ret_overflow instead of
 * wrapping when they exceed INT64_MAX; returns the first byte after them. */
static const char *scan_digits(const char *s, int64_t *ret_value, bool *ret_overflow) {
  int64_t v = 0;
  bool overflow = false;
  for (; is_digit(*s); s++) {
    if (!overflow && (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, *s - '0', &v)))
      overflow = true;
  }
  *ret_value = v;
  *ret_overflow = overflow;
  return s;
}

static int format_scaled(int64_t v, const unit_t *units, size_t n, const char *zero_unit, char *buf,
                         size_t size) {
  const unit_t *u = &units[n - 1];
  if (v == 0) {
    int len = snprintf(buf, size, "0%s", zero_unit);
    return (size_t)len < size ? len : -ENOSPC;
  }
  for (size_t i = 0; i < n; i++) {
    if (v % units[i].factor == 0) {
      u = &units[i];
      break;
    }
  }
  int len = snprintf(buf, size, "%lld%s", (long long)(v / u->factor), u->name);
  return (size_t)len < size ? len : -ENOSPC;
}

int fsdp_config_value_format(const fsdp_option_t *opt, int64_t number, char *buf, size_t size) {
  int len;
  switch (opt->type) {
  case FSDP_OPT_BOOL:
    len = snprintf(buf, size, "%s", number ? "true" : "false");
    break;
  case FSDP_OPT_INT:
    len = snprintf(buf, size, "%lld", (long long)number);
    break;
  case FSDP_OPT_SIZE:
    return format_scaled(number, size_units, N_UNITS(size_units), "B", buf, size);
  case FSDP_OPT_DURATION:
    return format_scaled(number, duration_units, N_UNITS(duration_units), "s", buf, size);
  case FSDP_OPT_ENUM: {
    const char *c = opt->choices;
    for (int64_t i = 0; c && i < number; i++) {
      c = strchr(c, '|');
      if (c)
        c++;
    }
    if (!c || number < 0)
      return -EINVAL;
    len = snprintf(buf, size, "%.*s", (int)strcspn(c, "|"), c);
    break;
  }
  default:
    return -EINVAL;
  }
  return (size_t)len < size ? len : -ENOSPC;
}

static int check_range(const fsdp_option_t *opt, const char *text, int64_t v, char *why,
                       size_t why_size) {
  char bound[32];
  if (v < opt->min) {
    fsdp_config_value_format(opt, opt->min, bound, sizeof bound);
    snprintf(why, why_size, "value " ECHO_FMT " is below the minimum %s", ECHO_ARG(text), bound);
    return FSDP_E_CONFIG;
  }
  if (v > opt->max) {
    fsdp_config_value_format(opt, opt->max, bound, sizeof bound);
    snprintf(why, why_size, "value " ECHO_FMT " is above the maximum %s", ECHO_ARG(text), bound);
    return FSDP_E_CONFIG;
  }
  return 0;
}

static int parse_int(const fsdp_option_t *opt, const char *text, int64_t *ret_number, char *why,
                     size_t why_size) {
  bool negative = text[0] == '-';
  const char *digits = text + negative;
  int64_t v;
  bool overflow;
  if (!is_digit(*digits) || *scan_digits(digits, &v, &overflow) != '\0') {
    snprintf(why, why_size, "value " ECHO_FMT " is not a whole number", ECHO_ARG(text));
    return FSDP_E_CONFIG;
  }
  /* Past 64 bits the value is certainly outside [min, max]; say which side. */
  if (overflow)
    v = negative ? INT64_MIN : INT64_MAX;
  else if (negative)
    v = -v;
  int r = check_range(opt, text, v, why, why_size);
  if (r < 0)
    return r;
  *ret_number = v;
  return 0;
}

static int parse_scaled(const fsdp_option_t *opt, const char *text, int64_t *ret_number, char *why,
                        size_t why_size) {
  bool is_size = opt->type == FSDP_OPT_SIZE;
  const unit_t *units = is_size ? size_units : duration_units;
  size_t n = is_size ? N_UNITS(size_units) : N_UNITS(duration_units);
  const char *unit_list = is_size ? "B, KiB, MiB, GiB or TiB" : "ms, s, m or h";

  if (text[0] == '-' && is_digit(text[1])) {
    snprintf(why, why_size, "value " ECHO_FMT " is negative", ECHO_ARG(text));
    return FSDP_E_CONFIG;
  }
  int64_t v = 0;
  bool overflow = false;
  const char *suffix = is_digit(text[0]) ? scan_digits(text, &v, &overflow) : NULL;
  bool suffix_is_word = suffix && *suffix != '\0';
  for (const char *c = suffix; suffix_is_word && *c; c++)
    suffix_is_word = is_alpha(*c);
  if (!suffix || (*suffix != '\0' && !suffix_is_word)) {
    if (is_size)
      snprintf(why, why_size,
               "value " ECHO_FMT " is not a size: expected a whole number of bytes with an "
               "optional unit %s, e.g. 16MiB",
               ECHO_ARG(text), unit_list);
    else
      snprintf(why, why_size,
               "value " ECHO_FMT " is not a duration: expected a whole number with a unit %s, "
               "e.g. 5s",
               ECHO_ARG(text), unit_list);
    return FSDP_E_CONFIG;
  }

  int64_t factor = 0;
  if (*suffix == '\0') {
    if (!is_size) {
      snprintf(why, why_size, "value " ECHO_FMT " needs a unit: %s", ECHO_ARG(text), unit_list);
      return FSDP_E_CONFIG;
    }
    factor = 1;
  }
  for (size_t i = 0; i < n && factor == 0; i++)
    if (strcmp(suffix, units[i].name) == 0)
      factor = units[i].factor;
  if (factor == 0) {
    snprintf(why, why_size, "value " ECHO_FMT " has an unknown unit '%.16s': use %s%s",
             ECHO_ARG(text), suffix, unit_list, is_size ? " (binary: 1KiB = 1024B)" : "");
    return FSDP_E_CONFIG;
  }
  /* Every bound fits in int64_t, so a product past it is above the maximum. */
  if (overflow || __builtin_mul_overflow(v, factor, &v))
    v = INT64_MAX;
  int r = check_range(opt, text, v, why, why_size);
  if (r < 0)
    return r;
  *ret_number = v;
  return 0;
}

static int parse_enum(const fsdp_option_t *opt, const char *text, int64_t *ret_number, char *why,
                      size_t why_size) {
  size_t len = strlen(text);
  int64_t index = 0;
  for (const char *c = opt->choices; c; index++) {
    size_t choice_len = strcspn(c, "|");
    if (choice_len == len && strncmp(c, text, len) == 0) {
      *ret_number = index;
      return 0;
    }
    c = c[choice_len] ? c + choice_len + 1 : NULL;
  }
  snprintf(why, why_size, "value " ECHO_FMT " is not one of %s", ECHO_ARG(text), opt->choices);
  return FSDP_E_CONFIG;
}

static int parse_bool(const char *text, int64_t *ret_number, char *why, size_t why_size) {
  static const char *const truths[] = {"true", "yes", "on", "1"};
  static const char *const lies[] = {"false", "no", "off", "0"};
  for (size_t i = 0; i < N_UNITS(truths); i++) {
    if (strcmp(text, truths[i]) == 0 || strcmp(text, lies[i]) == 0) {
      *ret_number = strcmp(text, truths[i]) == 0;
      return 0;
    }
  }
  snprintf(why, why_size, "value " ECHO_FMT " is not a boolean: use true|false, yes|no, on|off or 1|0",
           ECHO_ARG(text));
  return FSDP_E_CONFIG;
}

static bool is_host_char(char c) {
  return is_alpha(c) || is_digit(c) || c == '.' || c == '-' || c == '_';
}

static int parse_address(const char *text, char *why, size_t why_size) {
  /* Empty is the documented way to disable the service. */
  if (text[0] == '\0')
    return 0;
  const char *host = text, *port;
  size_t host_len;
  const char *problem = NULL;
  char detail[96];
  if (text[0] == '[') {
    const char *close = strchr(text, ']');
    host = text + 1;
    host_len = close ? (size_t)(close - host) : 0;
    char v6[INET6_ADDRSTRLEN];
    struct in6_addr addr;
    if (!close || close[1] != ':') {
      problem = "expected ':PORT' after the closing ']'";
    } else if (host_len == 0 || host_len >= sizeof v6) {
      problem = "the IPv6 host is empty or too long";
    } else {
      memcpy(v6, host, host_len);
      v6[host_len] = '\0';
      if (inet_pton(AF_INET6, v6, &addr) != 1) {
        snprintf(detail, sizeof detail, "'%s' is not an IPv6 address", v6);
        problem = detail;
      }
    }
    port = close ? close + 2 : NULL;
  } else {
    const char *colon = strrchr(text, ':');
    host_len = colon ? (size_t)(colon - text) : strlen(text);
    port = colon ? colon + 1 : NULL;
    if (!colon)
      problem = "no ':PORT'";
    else if (memchr(host, ':', host_len))
      problem = "an IPv6 host needs brackets, e.g. [::1]:7071";
    else if (host_len == 0)
      problem = "the host is empty";
    for (size_t i = 0; !problem && i < host_len; i++)
      if (!is_host_char(host[i]))
        problem = "the host may hold only letters, digits, '.', '-' and '_'";
  }
  if (!problem) {
    int64_t v;
    bool overflow;
    if (!is_digit(*port) || *scan_digits(port, &v, &overflow) != '\0' || overflow || v > 65535)
      problem = "the port is not a number 0..65535";
  }
  if (problem) {
    snprintf(why, why_size, "value " ECHO_FMT " is not HOST:PORT or [IPv6]:PORT: %s", ECHO_ARG(text),
             problem);
    return FSDP_E_CONFIG;
  }
  return 0;
}

int fsdp_config_value_list_item(const char *text, unsigned index, char *buf, size_t size) {
  const char *s = text;
  for (unsigned i = 0;; i++) {
    size_t len = strcspn(s, ",");
    const char *begin = s, *end = s + len;
    while (begin < end && (*begin == ' ' || *begin == '\t'))
      begin++;
    while (end > begin && (end[-1] == ' ' || end[-1] == '\t'))
      end--;
    if (i == index) {
      if ((size_t)(end - begin) >= size)
        return -ENOSPC;
      memcpy(buf, begin, (size_t)(end - begin));
      buf[end - begin] = '\0';
      return (int)(end - begin);
    }
    if (s[len] == '\0')
      return -ENOENT;
    s += len + 1;
  }
}

unsigned fsdp_config_value_list_count(const char *text) {
  unsigned n = 0;
  char item[8];
  /* An empty list has no items; "a" has one; every comma adds one. */
  if (fsdp_config_value_list_item(text, 0, item, sizeof item) == 0 && !strchr(text, ','))
    return 0;
  for (const char *c = text; *c; c++)
    n += *c == ',';
  return n + 1;
}

/* A comma-separated list of distinct addresses with real ports (peers connect to them). */
static int parse_address_list(const char *text, char *why, size_t why_size) {
  unsigned n = fsdp_config_value_list_count(text);
  if (n > FSDP_CONFIG_LIST_MAX) {
    snprintf(why, why_size, "%u addresses, at most %d", n, FSDP_CONFIG_LIST_MAX);
    return FSDP_E_CONFIG;
  }
  char item[FSDP_CONFIG_ADDRESS_MAX], other[FSDP_CONFIG_ADDRESS_MAX], inner[256];
  for (unsigned i = 0; i < n; i++) {
    if (fsdp_config_value_list_item(text, i, item, sizeof item) < 0) {
      snprintf(why, why_size, "address %u is longer than %d characters", i,
               FSDP_CONFIG_ADDRESS_MAX - 1);
      return FSDP_E_CONFIG;
    }
    if (item[0] == '\0') {
      snprintf(why, why_size, "address %u is empty (value " ECHO_FMT ")", i, ECHO_ARG(text));
      return FSDP_E_CONFIG;
    }
    if (parse_address(item, inner, sizeof inner) < 0) {
      snprintf(why, why_size, "address %u: %s", i, inner);
      return FSDP_E_CONFIG;
    }
    const char *port = strrchr(item, ':') + 1;
    if (strcmp(port, "0") == 0 || (port[0] == '0' && port[1])) {
      snprintf(why, why_size, "address %u " ECHO_FMT ": port %s, expected 1..65535", i,
               ECHO_ARG(item), port);
      return FSDP_E_CONFIG;
    }
    for (unsigned j = 0; j < i; j++) {
      fsdp_config_value_list_item(text, j, other, sizeof other);
      if (strcmp(item, other) == 0) {
        snprintf(why, why_size, "address %u " ECHO_FMT " repeats address %u: hosts are distinct",
                 i, ECHO_ARG(item), j);
        return FSDP_E_CONFIG;
      }
    }
  }
  return 0;
}

int fsdp_config_value_parse(const fsdp_option_t *opt, const char *text, int64_t *ret_number,
                            char *why, size_t why_size) {
  int64_t number = 0;
  int r = 0;
  switch (opt->type) {
  case FSDP_OPT_BOOL:
    r = parse_bool(text, &number, why, why_size);
    break;
  case FSDP_OPT_INT:
    r = parse_int(opt, text, &number, why, why_size);
    break;
  case FSDP_OPT_SIZE:
  case FSDP_OPT_DURATION:
    r = parse_scaled(opt, text, &number, why, why_size);
    break;
  case FSDP_OPT_ENUM:
    r = parse_enum(opt, text, &number, why, why_size);
    break;
  case FSDP_OPT_PATH:
    if (text[0] == '\0') {
      snprintf(why, why_size, "value '' is empty: a path is required");
      r = FSDP_E_CONFIG;
    }
    break;
  case FSDP_OPT_ADDRESS:
    r = parse_address(text, why, why_size);
    break;
  case FSDP_OPT_ADDRESS_LIST:
    r = parse_address_list(text, why, why_size);
    break;
  case FSDP_OPT_STRING:
    break;
  }
  if (r < 0)
    return r;
  *ret_number = number;
  return 0;
}
