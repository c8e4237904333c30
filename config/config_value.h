/* Value syntax of config options: text to number and back, one function per direction.
 *
 * Internal to config/ (and its tests): config.c applies these to every source, so that a
 * file, the environment and a flag accept exactly the same spellings. Pure functions of
 * their arguments; safe from any thread. */
#ifndef FSDP_CONFIG_VALUE_H
#define FSDP_CONFIG_VALUE_H

#include <stddef.h>
#include <stdint.h>

#include "config/option.h"

/* Checks text against opt's type and range. On success writes the number (BOOL 0/1, INT,
 * SIZE bytes, DURATION ms, ENUM index; 0 for text types) to *ret_number and returns 0. On
 * failure returns FSDP_E_CONFIG and writes the reason ("value '2TiB' is above the maximum
 * 1GiB") to why, without the key or origin, which the caller knows. */
int fsdp_config_value_parse(const fsdp_option_t *opt, const char *text, int64_t *ret_number,
                            char *why, size_t why_size);

/* Writes the canonical spelling of a number of opt's type (16MiB, 1500ms, info, true) to buf.
 * Returns its length, -ENOSPC if buf is too small, -EINVAL for a text type or a number
 * outside an ENUM's choices. */
int fsdp_config_value_format(const fsdp_option_t *opt, int64_t number, char *buf, size_t size);

/* Lists (FSDP_OPT_ADDRESS_LIST): items are separated by ',' and trimmed of blanks. */
#define FSDP_CONFIG_LIST_MAX 4096
#define FSDP_CONFIG_ADDRESS_MAX 300
/* The number of items; 0 for an empty (or blank) text. */
unsigned fsdp_config_value_list_count(const char *text);
/* Copies item `index` into buf; its length, -ENOENT past the end, -ENOSPC if too long. */
int fsdp_config_value_list_item(const char *text, unsigned index, char *buf, size_t size);

#endif
