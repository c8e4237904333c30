/* Fuzz harness of the checkpoint readers (checkpoint/checkpoint.h): the manifest, a host's
 * metadata and its .bin, as checkpoint_files.h splits the input. Any files either open as a
 * checkpoint whose every unit reads back whole (its parameters within its elements), or are
 * refused saying why; never a crash, a hang or a read past what the files hold. */
#include <stdint.h>
#include <stdlib.h>

#include "checkpoint/checkpoint.h"
#include "tests/fuzz/checkpoint_files.h"

/* Elements read per call, as a load or an export reads them: a few chunks of a unit. */
#define READ_ELEMS 4096

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const char *dir = fuzz_checkpoint(data, size);
  fsdp_checkpoint_reader_t *r;
  fsdp_status_t st = FSDP_STATUS_INIT;
  if (fsdp_checkpoint_open(dir, NULL, &r, &st) < 0) {
    if (st.code >= 0 || st.message[0] == '\0')
      abort(); /* a refusal says why */
    return 0;
  }
  static float buf[READ_ELEMS];
  size_t n_units;
  const fsdp_checkpoint_unit_t *units = fsdp_checkpoint_units(r, &n_units);
  for (size_t i = 0; i < n_units; i++) {
    const fsdp_checkpoint_unit_t *u = &units[i];
    for (size_t k = 0; k < u->n_params; k++) {
      uint64_t numel = 1;
      for (size_t d = 0; d < u->params[k].ndim; d++)
        if (__builtin_mul_overflow(numel, u->params[k].shape[d], &numel))
          abort();
      if (u->params[k].offset > u->numel || numel > u->numel - u->params[k].offset)
        abort();
    }
    /* Every block whole, and a little past the end (zeros or a refusal, never a read). */
    for (unsigned b = 0; b <= u->arrays; b++) {
      for (uint64_t e = 0; e < u->numel + 8;) {
        uint64_t n = u->numel + 8 - e < READ_ELEMS ? u->numel + 8 - e : READ_ELEMS;
        if (fsdp_checkpoint_read_elements(r, i, b, e, n, buf, &st) < 0) {
          if (st.message[0] == '\0')
            abort();
          break;
        }
        e += n;
      }
    }
    if (fsdp_checkpoint_read_elements(r, i, u->arrays + 1, 0, 1, buf, &st) == 0)
      abort(); /* no such block */
  }
  (void)fsdp_checkpoint_optimizer_steps(r, n_units); /* past the units: harmless */
  fsdp_checkpoint_close(r);
  return 0;
}
