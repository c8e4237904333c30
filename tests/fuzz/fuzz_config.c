/* Fuzz harness of the config file parser: the input is INI text for fsdp_config_load_string
 * on a fresh config. Errors are expected; crashes, leaks and sanitizer reports are not. A
 * success is checked further: every value it leaves must format, since the daemon shows it. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "config/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* The parser takes a C string; a NUL inside the input simply ends it early. */
  char *text = malloc(size + 1);
  if (!text)
    return 0;
  memcpy(text, data, size);
  text[size] = '\0';

  fsdp_config_t cfg;
  fsdp_status_t st = FSDP_STATUS_INIT;
  if (fsdp_config_init(&cfg) == 0) {
    if (fsdp_config_load_string(&cfg, text, "fuzz.conf", &st) == 0) {
      for (int i = 0; i < FSDP_OPTION_COUNT; i++) {
        char buf[512];
        if (fsdp_config_format(&cfg, (fsdp_option_id_t)i, buf, sizeof buf) < 0)
          abort();
      }
    } else if (st.code >= 0 || st.message[0] == '\0') {
      /* A failure must say why. */
      abort();
    }
  }
  fsdp_config_cleanup(&cfg);
  free(text);
  return 0;
}
