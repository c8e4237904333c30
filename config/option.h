/* fsdp_option_t: what config/config.h's option table says of one option: its key, the type
 * and range of its value, and its help. Apart from config.h so that the value syntax
 * (config/config_value.h) reads it without depending on the table that uses it. */
#ifndef FSDP_CONFIG_OPTION_H
#define FSDP_CONFIG_OPTION_H

#include <stdbool.h>
#include <stdint.h>

typedef enum fsdp_option_type {
  FSDP_OPT_BOOL,     /* true/false, yes/no, on/off, 1/0 */
  FSDP_OPT_INT,      /* decimal integer within [min, max] */
  FSDP_OPT_SIZE,     /* bytes: "4096", "64KiB", "16MiB", "2GiB"; within [min, max] bytes */
  FSDP_OPT_DURATION, /* milliseconds: "250ms", "5s", "2m", "1h"; within [min, max] ms */
  FSDP_OPT_STRING,   /* free text */
  FSDP_OPT_PATH,     /* a filesystem path; not empty */
  FSDP_OPT_ENUM,     /* one of `choices`; the value is the index */
  FSDP_OPT_ADDRESS,  /* HOST:PORT or [V6]:PORT, port 0..65535; empty disables */
  FSDP_OPT_ADDRESS_LIST, /* ADDRESS,ADDRESS,...: distinct, each with a port 1..65535; may be empty */
} fsdp_option_type_t;

typedef struct fsdp_option {
  const char *key;
  fsdp_option_type_t type;
  const char *default_value; /* spelled as in the file */
  int64_t min, max;
  const char *choices;
  const char *unit;
  bool reloadable;
  const char *flag;
  const char *help;
} fsdp_option_t;

#endif
