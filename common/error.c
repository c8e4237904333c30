/* Descriptions of domain error codes and of -errno values. */
#include <string.h>

#include <fsdp/fsdp_error.h>

const char *fsdp_strerror(int err) {
  switch (err) {
#define FSDP_ERROR_TEXT(name, value, text) \
  case name:                               \
    return text;
    FSDP_ERROR_LIST(FSDP_ERROR_TEXT)
#undef FSDP_ERROR_TEXT
  default:
    break;
  }
  if (err < 0 && err > -4096) {
    /* strerrordesc_np returns a static string, unlike strerror which may share a buffer. */
    const char *text = strerrordesc_np(-err);
    if (text)
      return text;
  }
  return err >= 0 ? "success" : "unknown error code";
}

const char *fsdp_error_name(int err) {
  switch (err) {
#define FSDP_ERROR_NAME(name, value, text) \
  case name:                               \
    return #name;
    FSDP_ERROR_LIST(FSDP_ERROR_NAME)
#undef FSDP_ERROR_NAME
  default:
    return NULL;
  }
}
