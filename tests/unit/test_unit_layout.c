/* Unit layouts and spec checks: padding and equal shards for numels that do and do not
 * divide, PER_PARAM's pieces and the runs of both layouts against the definition, every
 * refusal with its message, and the first-difference report. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/services/unit_spec.h"
#include "daemon/store/topology.h"
#include "daemon/store/unit_layout.h"

/* A spec with up to 4 parameters, all fp32, FULL_SHARD. */
typedef struct spec_storage {
  fsdp_unit_spec_t spec;
  fsdp_param_spec_t params[4];
  uint64_t shapes[4][4];
} spec_storage_t;

static void make_spec(spec_storage_t *s, const char *unit, size_t n, const char *const *names,
                      const uint64_t (*shapes)[4], const size_t *ndims) {
  memset(s, 0, sizeof *s);
  s->spec.unit = (char *)unit;
  s->spec.strategy = FSDP_UNIT_FULL_SHARD;
  for (size_t i = 0; i < n; i++) {
    s->params[i].name = (char *)names[i];
    s->params[i].dtype = FSDP_UNIT_DTYPE_FP32;
    s->params[i].requires_grad = true;
    memcpy(s->shapes[i], shapes[i], sizeof s->shapes[i]);
    s->params[i].shape = s->shapes[i];
    s->params[i].n_shape = ndims[i];
  }
  s->spec.params = s->params;
  s->spec.n_params = n;
}

static const char *const wb[] = {"weight", "bias", "scale", "extra"};
static const uint64_t shapes_4096x1023[4][4] = {{4096, 1023}, {1023}, {0}, {0}};
static const size_t ndims_2_1[] = {2, 1, 0, 0};

static void test_layout_pads_to_a_multiple_of_the_shards(void **state) {
  (void)state;
  spec_storage_t s;
  make_spec(&s, "layer0", 2, wb, shapes_4096x1023, ndims_2_1);
  fsdp_status_t st;
  assert_int_equal(fsdp_unit_spec_check(&s.spec, &st), 0);
  for (unsigned shards = 1; shards <= 8; shards++) {
    fsdp_unit_layout_t l;
    assert_int_equal(fsdp_unit_layout_init(&l, &s.spec, shards, shards, &st), 0);
    uint64_t numel = 4096ull * 1023 + 1023;
    assert_int_equal(l.numel, numel);
    assert_int_equal(l.padded_numel % shards, 0);
    assert_true(l.padded_numel >= numel && l.padded_numel - numel < shards);
    assert_int_equal(l.shard_numel * shards, l.padded_numel);
    assert_int_equal(l.offsets[0], 0);
    assert_int_equal(l.offsets[1], 4096ull * 1023);
    assert_int_equal(l.numels[1], 1023);
    uint64_t begin, end;
    fsdp_unit_layout_shard_range(&l, shards - 1, &begin, &end);
    assert_int_equal(end, l.padded_numel);
    assert_int_equal(end - begin, l.shard_numel);
    fsdp_unit_layout_cleanup(&l);
  }
  /* 4096 * 1023 + 1023 = 4191231 = 3 * 1397077: divisible by 3, not by 2 or 4. */
  fsdp_unit_layout_t l;
  assert_int_equal(fsdp_unit_layout_init(&l, &s.spec, 3, 3, &st), 0);
  assert_int_equal(l.padded_numel, l.numel);
  fsdp_unit_layout_cleanup(&l);
  assert_int_equal(fsdp_unit_layout_init(&l, &s.spec, 4, 4, &st), 0);
  assert_int_equal(l.padded_numel - l.numel, 1);
  fsdp_unit_layout_cleanup(&l);
}

/* PER_PARAM by its definition: element e of the shards' space is in shard e / shard_numel;
 * there, parameter k's piece holds its rows [s * rows_k, (s + 1) * rows_k) from
 * shard_offsets[k]; a row past the parameter's last, or an element past every piece, is
 * padding (-1). Otherwise the element's offset in the unsharded buffer. */
static int64_t per_param_at(const fsdp_unit_layout_t *l, uint64_t e) {
  uint64_t s = e / l->shard_numel, w = e % l->shard_numel;
  for (size_t k = 0; k < l->n_params; k++) {
    uint64_t q = l->row_numels[k], off = l->shard_offsets[k];
    if (q == 0 || w < off || w >= off + l->rows_per_shard[k] * q)
      continue;
    uint64_t row = s * l->rows_per_shard[k] + (w - off) / q;
    if (row >= l->numels[k] / q)
      return -1;
    return (int64_t)(l->offsets[k] + row * q + (w - off) % q);
  }
  return -1;
}

/* The runs of [begin, end) name each element as the definition does (FLAT: itself), are
 * consecutive, none is empty, and padding is never followed by padding. */
static void check_runs(const fsdp_unit_layout_t *l, uint64_t begin, uint64_t end) {
  fsdp_unit_runs_t it = fsdp_unit_runs(l, begin, end);
  uint64_t at = begin;
  bool padding = false;
  for (fsdp_unit_run_t run; fsdp_unit_runs_next(&it, &run);) {
    assert_int_equal(run.shard_at, at);
    assert_true(run.numel > 0);
    assert_false(padding && run.padding);
    padding = run.padding;
    for (uint64_t i = 0; i < run.numel; i++) {
      int64_t want = fsdp_unit_layout_is_flat(l) ? (int64_t)(at + i) : per_param_at(l, at + i);
      assert_int_equal(run.padding ? -1 : (int64_t)(run.unsharded_at + i), want);
    }
    at += run.numel;
  }
  assert_int_equal(at, end);
}

static void test_per_param_pieces_are_torch_chunks(void **state) {
  (void)state;
  /* weight [10, 3], bias [10], a scalar, an empty [0, 4], over 4 shards padded to 8: rows
   * per shard 3, 3, 1, 0 (torch.chunk's ceil(10 / 4) = 3: 3, 3, 3, 1 rows), pieces at 0, 9,
   * 12, 13, 13 elements a shard, padded to 14. */
  static const uint64_t shapes[4][4] = {{10, 3}, {10}, {0}, {0, 4}};
  static const size_t ndims[] = {2, 1, 0, 2};
  spec_storage_t s;
  make_spec(&s, "block", 4, wb, shapes, ndims);
  s.spec.layout = FSDP_UNIT_LAYOUT_PER_PARAM;
  fsdp_status_t st;
  assert_int_equal(fsdp_unit_spec_check(&s.spec, &st), 0);
  fsdp_unit_layout_t l;
  assert_int_equal(fsdp_unit_layout_init(&l, &s.spec, 4, 8, &st), 0);
  assert_int_equal(l.numel, 41);
  assert_int_equal(l.shard_numel, 14);
  assert_int_equal(l.padded_numel, 56);
  const uint64_t offsets[] = {0, 9, 12, 13}, rows[] = {3, 3, 1, 0};
  for (size_t k = 0; k < 4; k++) {
    assert_int_equal(l.shard_offsets[k], offsets[k]);
    assert_int_equal(l.rows_per_shard[k], rows[k]);
  }
  /* Shard 3 holds the weight's row 9 and the bias's element 9, the rest padding. */
  uint64_t begin, end, at;
  fsdp_unit_layout_param_in_shard(&l, 0, 3, &begin, &end, &at);
  assert_int_equal(begin, 42);
  assert_int_equal(end, 45);
  assert_int_equal(at, 27);
  fsdp_unit_layout_param_in_shard(&l, 2, 1, &begin, &end, &at);
  assert_int_equal(end - begin, 0); /* the scalar is shard 0's alone */
  fsdp_unit_runs_t it = fsdp_unit_runs(&l, 42, 56);
  fsdp_unit_run_t run;
  const fsdp_unit_run_t want[] = {{42, 27, 3, false}, {45, 0, 6, true}, {51, 39, 1, false},
                                  {52, 0, 4, true}};
  for (size_t i = 0; i < 4; i++) {
    assert_true(fsdp_unit_runs_next(&it, &run));
    assert_int_equal(run.shard_at, want[i].shard_at);
    assert_int_equal(run.numel, want[i].numel);
    assert_int_equal(run.padding, want[i].padding);
    if (!want[i].padding)
      assert_int_equal(run.unsharded_at, want[i].unsharded_at);
  }
  assert_false(fsdp_unit_runs_next(&it, &run));
  fsdp_unit_layout_cleanup(&l);
}

/* Every range of both layouts, over 1 to 9 shards and paddings, against the definition;
 * each parameter's element in exactly one place, and param_in_shard agreeing with the
 * runs. */
static void test_runs_follow_the_definition(void **state) {
  (void)state;
  static const uint64_t shapes[4][4] = {{7, 5}, {0}, {13}, {3, 2, 2}}; /* an empty second */
  static const size_t ndims[] = {2, 1, 1, 3};
  spec_storage_t s;
  make_spec(&s, "block", 4, wb, shapes, ndims);
  fsdp_status_t st;
  for (int kind = 0; kind < 2; kind++) {
    s.spec.layout = kind ? FSDP_UNIT_LAYOUT_PER_PARAM : FSDP_UNIT_LAYOUT_FLAT;
    for (unsigned shards = 1; shards <= 9; shards++) {
      for (unsigned pad = 1; pad <= 3; pad++) {
        fsdp_unit_layout_t l;
        assert_int_equal(fsdp_unit_layout_init(&l, &s.spec, shards, shards * pad, &st), 0);
        assert_int_equal(l.padded_numel, l.shard_numel * shards);
        assert_int_equal(l.shard_numel % pad, 0);
        for (uint64_t a = 0; a <= l.padded_numel; a += 3)
          for (uint64_t b = a; b <= l.padded_numel; b += 5)
            check_runs(&l, a, b);
        unsigned seen[64] = {0};
        for (uint64_t e = 0; e < l.padded_numel; e++) {
          int64_t at = kind ? per_param_at(&l, e) : (e < l.numel ? (int64_t)e : -1);
          if (at >= 0)
            seen[at]++;
        }
        for (uint64_t i = 0; i < l.numel; i++)
          assert_int_equal(seen[i], 1);
        for (size_t k = 0; k < l.n_params; k++)
          for (unsigned sh = 0; sh < shards; sh++) {
            uint64_t begin, end, at;
            fsdp_unit_layout_param_in_shard(&l, k, sh, &begin, &end, &at);
            for (uint64_t e = begin; e < end; e++) {
              int64_t want = kind ? per_param_at(&l, e) : (int64_t)e;
              assert_int_equal(want, (int64_t)(at + e - begin));
              assert_true(at + e - begin >= l.offsets[k] &&
                          at + e - begin < l.offsets[k] + l.numels[k]);
            }
          }
        fsdp_unit_layout_cleanup(&l);
      }
    }
  }
}

/* Every host's plan over a topology: shard ownership covers [0, S) once per shard group,
 * rings agree between their members, and padding lets a host's region split among its
 * replicas. */
static void check_plans(unsigned hosts, unsigned group, unsigned l,
                        fsdp_unit_strategy_t strategy) {
  unsigned owners[64] = {0};
  uint64_t replicas[64] = {0}; /* bit k: some rank holds the shard as copy k */
  unsigned holders[64] = {0};
  for (unsigned h = 0; h < hosts; h++) {
    fsdp_topology_t t = {.hosts = hosts, .host_rank = h, .shard_group_hosts = group};
    fsdp_unit_plan_t p;
    fsdp_unit_plan(&t, strategy, l, &p);
    assert_int_equal(p.data_parallel_size, hosts * l);
    assert_int_equal(p.pad_multiple % p.shards, 0);
    assert_int_equal(p.pad_multiple % (p.shards * p.replica_ring.members), 0);
    assert_int_equal(p.shard_ring.members * p.replica_ring.members * p.local_shards,
                     strategy == FSDP_UNIT_NO_SHARD ? hosts : hosts * l);
    assert_int_equal(fsdp_host_ring_host(&p.shard_ring, p.shard_ring.self), h);
    assert_int_equal(fsdp_host_ring_host(&p.replica_ring, p.replica_ring.self), h);
    for (unsigned s = 0; s < p.local_shards; s++)
      owners[p.first_shard + s]++;
    for (unsigned r = 0; r < l; r++) {
      unsigned shard = p.first_shard + (p.local_shards == 1 ? 0 : r);
      unsigned copy = fsdp_unit_plan_replica(&p, r);
      assert_true(copy < 64);
      assert_false(replicas[shard] >> copy & 1); /* no two ranks hold the same copy */
      replicas[shard] |= 1ull << copy;
      holders[shard]++;
    }
    /* The members of this host's shard ring hold consecutive regions, in ring order. */
    for (unsigned i = 0; i < p.shard_ring.members; i++) {
      fsdp_topology_t ti = t;
      ti.host_rank = fsdp_host_ring_host(&p.shard_ring, i);
      fsdp_unit_plan_t pi;
      fsdp_unit_plan(&ti, strategy, l, &pi);
      assert_int_equal(pi.first_shard, i * p.local_shards);
      assert_int_equal(pi.shard_ring.first, p.shard_ring.first);
      assert_int_equal(pi.shard_ring.self, i);
    }
  }
  unsigned groups = strategy == FSDP_UNIT_HYBRID_SHARD ? hosts / group
                    : strategy == FSDP_UNIT_NO_SHARD   ? hosts
                                                                          : 1;
  fsdp_topology_t t0 = {.hosts = hosts, .host_rank = 0, .shard_group_hosts = group};
  fsdp_unit_plan_t p0;
  fsdp_unit_plan(&t0, strategy, l, &p0);
  for (unsigned s = 0; s < p0.shards; s++) {
    assert_int_equal(owners[s], groups);
    /* The copies of a shard are numbered 0, 1, ... */
    assert_int_equal(replicas[s], holders[s] == 64 ? ~0ull : (1ull << holders[s]) - 1);
  }
}

static void test_plans_across_hosts(void **state) {
  (void)state;
  static const fsdp_unit_strategy_t all[] = {
      FSDP_UNIT_FULL_SHARD, FSDP_UNIT_SHARD_GRAD_OP,
      FSDP_UNIT_HYBRID_SHARD, FSDP_UNIT_NO_SHARD};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) {
    check_plans(1, 1, 4, all[i]);
    check_plans(2, 1, 2, all[i]);
    check_plans(3, 1, 2, all[i]);
    check_plans(4, 2, 3, all[i]);
    check_plans(6, 3, 2, all[i]);
  }
  /* Two hosts of two ranks, HYBRID_SHARD with one host per group: S = 2, the replicas all-
   * reduce each host's region, so the padding goes to a multiple of 4. */
  fsdp_topology_t t = {.hosts = 2, .host_rank = 1, .shard_group_hosts = 1};
  fsdp_unit_plan_t p;
  fsdp_unit_plan(&t, FSDP_UNIT_HYBRID_SHARD, 2, &p);
  assert_int_equal(p.shards, 2);
  assert_int_equal(p.first_shard, 0);
  assert_int_equal(p.pad_multiple, 4);
  assert_int_equal(p.replica_ring.members, 2);
  assert_int_equal(p.replica_ring.self, 1);
  assert_int_equal(p.shard_ring.members, 1);
  /* One host: the layout of the single-host store. */
  t = (fsdp_topology_t){.hosts = 1, .host_rank = 0, .shard_group_hosts = 1};
  fsdp_unit_plan(&t, FSDP_UNIT_FULL_SHARD, 3, &p);
  assert_int_equal(p.shards, 3);
  assert_int_equal(p.pad_multiple, 3);
  assert_false(fsdp_unit_plan_spans_hosts(&p));
}

static void test_scalars_and_zero_size_parameters(void **state) {
  (void)state;
  static const uint64_t shapes[4][4] = {{0}, {3, 0}, {5}, {0}};
  static const size_t ndims[] = {0, 2, 1, 0};
  spec_storage_t s;
  make_spec(&s, "mixed", 3, wb, shapes, ndims);
  fsdp_status_t st;
  assert_int_equal(fsdp_unit_spec_check(&s.spec, &st), 0);
  fsdp_unit_layout_t l;
  assert_int_equal(fsdp_unit_layout_init(&l, &s.spec, 4, 4, &st), 0);
  assert_int_equal(l.numels[0], 1); /* a scalar */
  assert_int_equal(l.numels[1], 0); /* zero-size: kept, takes no room */
  assert_int_equal(l.offsets[1], 1);
  assert_int_equal(l.offsets[2], 1);
  assert_int_equal(l.numel, 6);
  assert_int_equal(l.padded_numel, 8);
  assert_int_equal(l.shard_numel, 2);
  fsdp_unit_layout_cleanup(&l);
}

static void expect_refusal(const fsdp_unit_spec_t *spec, const char *message) {
  fsdp_status_t st;
  assert_int_equal(fsdp_unit_spec_check(spec, &st), FSDP_E_INVALID_ARGUMENT);
  assert_string_equal(st.message, message);
}

static void test_refusals_name_the_field_and_value(void **state) {
  (void)state;
  spec_storage_t s;
  make_spec(&s, "", 2, wb, shapes_4096x1023, ndims_2_1);
  expect_refusal(&s.spec, "field 'unit' is empty");

  make_spec(&s, "layer1", 2, wb, shapes_4096x1023, ndims_2_1);
  s.spec.strategy = FSDP_UNIT_STRATEGY_UNSPECIFIED;
  expect_refusal(&s.spec, "unit 'layer1': field 'strategy' is unspecified; expected FULL_SHARD, "
                          "SHARD_GRAD_OP, HYBRID_SHARD or NO_SHARD");

  make_spec(&s, "layer1", 2, wb, shapes_4096x1023, ndims_2_1);
  s.spec.layout = (fsdp_unit_layout_kind_t)2;
  expect_refusal(&s.spec, "unit 'layer1': field 'layout' = 2 is not LAYOUT_FLAT or "
                          "LAYOUT_PER_PARAM");

  make_spec(&s, "layer1", 0, wb, shapes_4096x1023, ndims_2_1);
  expect_refusal(&s.spec, "unit 'layer1' has no parameters");

  static const char *const dup[] = {"w", "b", "w"};
  static const uint64_t three[4][4] = {{2}, {2}, {2}, {0}};
  static const size_t ones[] = {1, 1, 1, 0};
  make_spec(&s, "layer1", 3, dup, three, ones);
  expect_refusal(&s.spec, "unit 'layer1': parameter name 'w' appears more than once");

  static const char *const unnamed[] = {"w", ""};
  make_spec(&s, "layer1", 2, unnamed, three, ones);
  expect_refusal(&s.spec, "unit 'layer1': params[1].name is empty");

  make_spec(&s, "layer1", 2, wb, shapes_4096x1023, ndims_2_1);
  s.params[1].dtype = FSDP_UNIT_DTYPE_BF16;
  expect_refusal(&s.spec, "unit 'layer1': params[1] 'bias' is DTYPE_BF16 but params[0] 'weight' "
                          "is DTYPE_FP32; a unit holds one element type");
  s.params[1].dtype = FSDP_UNIT_DTYPE_UNSPECIFIED;
  expect_refusal(&s.spec, "unit 'layer1': params[1].dtype of 'bias' is unspecified");

  static const uint64_t zeros[4][4] = {{0}, {4, 0}, {0}, {0}};
  static const size_t zero_dims[] = {1, 2, 0, 0};
  make_spec(&s, "empty", 2, wb, zeros, zero_dims);
  expect_refusal(&s.spec, "unit 'empty' has no elements: every parameter has size 0");

  make_spec(&s, "layer1", 2, wb, shapes_4096x1023, ndims_2_1);
  s.spec.gradient_predivide_factor = -2;
  expect_refusal(&s.spec, "unit 'layer1': gradient_predivide_factor = -2, outside "
                          "[5.96046e-08 (2^-24), 1.67772e+07 (2^24)] (0 asks for the default)");
  s.spec.gradient_predivide_factor = 0;
  s.spec.gradient_postdivide_factor = NAN;
  expect_refusal(&s.spec, "unit 'layer1': gradient_postdivide_factor = nan, outside "
                          "[5.96046e-08 (2^-24), 1.67772e+07 (2^24)] (0 asks for the default)");
}

/* Issue 10 finding 14: factors that passed RegisterUnit and then failed every ReduceScatter
 * with INTERNAL (their fp32 reciprocals overflow), and the bounds' edges. */
static void test_gradient_factors_within_bounds(void **state) {
  (void)state;
  spec_storage_t s;
  make_spec(&s, "layer1", 2, wb, shapes_4096x1023, ndims_2_1);
  const double refused[] = {1e-310, 1e308, INFINITY, 0x1p-25, 0x1p24 * 1.0001};
  for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
    s.spec.gradient_predivide_factor = refused[i];
    fsdp_status_t st;
    assert_int_equal(fsdp_unit_spec_check(&s.spec, &st), FSDP_E_INVALID_ARGUMENT);
    assert_non_null(strstr(st.message, "unit 'layer1': gradient_predivide_factor = "));
  }
  s.spec.gradient_predivide_factor = 0x1p-24;
  s.spec.gradient_postdivide_factor = 0x1p24;
  fsdp_status_t st;
  assert_int_equal(fsdp_unit_spec_check(&s.spec, &st), 0);
  float pre, post;
  assert_int_equal(fsdp_unit_gradient_scales(&s.spec, 8, &pre, &post, &st), 0);
  assert_true(pre == 0x1p24f && post == 0x1p-24f);
  /* Each in bounds, the product not: together they divide by 2^32. */
  s.spec.gradient_predivide_factor = 0x1p16;
  s.spec.gradient_postdivide_factor = 0x1p16;
  expect_refusal(&s.spec, "unit 'layer1': gradient_predivide_factor * gradient_postdivide_factor "
                          "= 4.29497e+09, outside [5.96046e-08 (2^-24), 1.67772e+07 (2^24)] (0 "
                          "asks for the default)");
  /* A factor left 0 is the data-parallel size over the other: checked once the size is
   * known. */
  s.spec.gradient_postdivide_factor = 0;
  s.spec.gradient_predivide_factor = 0x1p-24;
  assert_int_equal(fsdp_unit_spec_check(&s.spec, &st), 0);
  assert_int_equal(fsdp_unit_gradient_scales(&s.spec, 2, &pre, &post, &st),
                   FSDP_E_INVALID_ARGUMENT);
  assert_string_equal(st.message,
                      "unit 'layer1': gradient_postdivide_factor (0: data-parallel size 2 / "
                      "gradient_predivide_factor 5.96046e-08) = 3.35544e+07, outside "
                      "[5.96046e-08 (2^-24), 1.67772e+07 (2^24)] (0 asks for the default)");
  s.spec.gradient_predivide_factor = 0;
  assert_int_equal(fsdp_unit_gradient_scales(&s.spec, 1u << 20, &pre, &post, &st), 0);
  assert_true(pre == 1.0f && post == 0x1p-20f);
  s.spec.gradient_postdivide_factor = 4;
  assert_int_equal(fsdp_unit_gradient_scales(&s.spec, 8, &pre, &post, &st), 0);
  assert_true(pre == 0.5f && post == 0.25f);
}

static void test_element_counts_that_overflow_are_refused(void **state) {
  (void)state;
  /* 2^32 * 2^32 wraps to 0 in 64 bits: must be caught, not accepted as empty. */
  static const uint64_t wraps[4][4] = {{1ull << 32, 1ull << 32}, {0}, {0}, {0}};
  static const size_t two[] = {2, 0, 0, 0};
  spec_storage_t s;
  make_spec(&s, "huge", 1, wb, wraps, two);
  expect_refusal(&s.spec, "unit 'huge': params[0] 'weight' shape[1] = 4294967296 takes the "
                          "product of its nonzero dimensions past the limit of 1099511627776 "
                          "elements");
  /* Each parameter fits, the sum does not. */
  static const uint64_t halves[4][4] = {{1ull << 39}, {1ull << 39}, {1}, {0}};
  static const size_t ones[] = {1, 1, 1, 0};
  make_spec(&s, "huge", 3, wb, halves, ones);
  expect_refusal(&s.spec, "unit 'huge': params[2] 'scale' shape [1] brings the unit past "
                          "1099511627776 elements");
  /* A zero dimension does not excuse the others (issue 10): [0, 2^64-1] is refused naming
   * the dimension, as is [2^40, 0, 2]. */
  static const uint64_t hidden[4][4] = {{0, UINT64_MAX}, {0}, {0}, {0}};
  make_spec(&s, "huge", 1, wb, hidden, two);
  expect_refusal(&s.spec, "unit 'huge': params[0] 'weight' shape[1] = 18446744073709551615 "
                          "takes the product of its nonzero dimensions past the limit of "
                          "1099511627776 elements");
  static const uint64_t product[4][4] = {{1ull << 40, 0, 2}, {0}, {0}, {0}};
  static const size_t three[] = {3, 0, 0, 0};
  make_spec(&s, "huge", 1, wb, product, three);
  expect_refusal(&s.spec, "unit 'huge': params[0] 'weight' shape[2] = 2 takes the product of "
                          "its nonzero dimensions past the limit of 1099511627776 elements");
}

static void test_diff_names_the_first_differing_field(void **state) {
  (void)state;
  spec_storage_t a, b;
  make_spec(&a, "layer3", 2, wb, shapes_4096x1023, ndims_2_1);
  make_spec(&b, "layer3", 2, wb, shapes_4096x1023, ndims_2_1);
  fsdp_spec_difference_t d;
  assert_false(fsdp_unit_spec_diff(&a.spec, &b.spec, &d));

  b.shapes[0][1] = 1024;
  assert_true(fsdp_unit_spec_diff(&a.spec, &b.spec, &d));
  assert_string_equal(d.field, "params[0].shape");
  assert_string_equal(d.a, "[4096,1023]");
  assert_string_equal(d.b, "[4096,1024]");

  b.spec.param_dtype = FSDP_UNIT_DTYPE_BF16; /* earlier in the order than the shapes */
  assert_true(fsdp_unit_spec_diff(&a.spec, &b.spec, &d));
  assert_string_equal(d.field, "param_dtype");
  assert_string_equal(d.a, "DTYPE_UNSPECIFIED");
  assert_string_equal(d.b, "DTYPE_BF16");

  make_spec(&b, "layer3", 1, wb, shapes_4096x1023, ndims_2_1);
  assert_true(fsdp_unit_spec_diff(&a.spec, &b.spec, &d));
  assert_string_equal(d.field, "params (count)");
  assert_string_equal(d.a, "2");
  assert_string_equal(d.b, "1");

  make_spec(&b, "layer3", 2, wb, shapes_4096x1023, ndims_2_1);
  b.params[1].requires_grad = false;
  assert_true(fsdp_unit_spec_diff(&a.spec, &b.spec, &d));
  assert_string_equal(d.field, "params[1].requires_grad");
}

static void test_dtype_defaults(void **state) {
  (void)state;
  spec_storage_t s;
  make_spec(&s, "layer0", 2, wb, shapes_4096x1023, ndims_2_1);
  assert_int_equal(fsdp_unit_spec_param_dtype(&s.spec), FSDP_UNIT_DTYPE_FP32);
  assert_int_equal(fsdp_unit_spec_reduce_dtype(&s.spec), FSDP_UNIT_DTYPE_FP32);
  s.spec.param_dtype = FSDP_UNIT_DTYPE_BF16;
  assert_int_equal(fsdp_unit_spec_reduce_dtype(&s.spec), FSDP_UNIT_DTYPE_BF16);
  s.spec.reduce_dtype = FSDP_UNIT_DTYPE_FP32;
  assert_int_equal(fsdp_unit_spec_reduce_dtype(&s.spec), FSDP_UNIT_DTYPE_FP32);
}

/* The service layer's conversion keeps every field of the request, and the store's copy
 * every field of the spec: neither differs from the spec built by hand. */
static void test_spec_from_a_request_and_its_copy(void **state) {
  (void)state;
  uint64_t weight_shape[] = {4096, 1023}, bias_shape[] = {1023};
  Fsdp__V1__ParamSpec params[2] = {FSDP__V1__PARAM_SPEC__INIT, FSDP__V1__PARAM_SPEC__INIT};
  Fsdp__V1__ParamSpec *ptrs[2] = {&params[0], &params[1]};
  for (size_t i = 0; i < 2; i++) {
    params[i].name = (char *)wb[i];
    params[i].dtype = FSDP__V1__DTYPE__DTYPE_BF16;
    params[i].requires_grad = i == 0;
  }
  params[0].shape = weight_shape;
  params[0].n_shape = 2;
  params[1].shape = bias_shape;
  params[1].n_shape = 1;
  Fsdp__V1__RegisterUnitRequest rq = FSDP__V1__REGISTER_UNIT_REQUEST__INIT;
  rq.session_id = 99;
  rq.unit = "layer3";
  rq.params = ptrs;
  rq.n_params = 2;
  rq.strategy = FSDP__V1__SHARDING_STRATEGY__HYBRID_SHARD;
  rq.param_dtype = FSDP__V1__DTYPE__DTYPE_FP16;
  rq.reduce_dtype = FSDP__V1__DTYPE__DTYPE_FP32;
  rq.gradient_predivide_factor = 2;
  rq.gradient_postdivide_factor = 0.5;

  spec_storage_t want;
  make_spec(&want, "layer3", 2, wb, shapes_4096x1023, ndims_2_1);
  want.spec.strategy = FSDP_UNIT_HYBRID_SHARD;
  want.spec.param_dtype = FSDP_UNIT_DTYPE_FP16;
  want.spec.reduce_dtype = FSDP_UNIT_DTYPE_FP32;
  want.spec.gradient_predivide_factor = 2;
  want.spec.gradient_postdivide_factor = 0.5;
  want.params[0].dtype = want.params[1].dtype = FSDP_UNIT_DTYPE_BF16;
  want.params[1].requires_grad = false;

  fsdp_unit_spec_t spec;
  assert_int_equal(fsdp_unit_spec_init_from_proto(&spec, &rq), 0);
  fsdp_spec_difference_t d;
  assert_false(fsdp_unit_spec_diff(&spec, &want.spec, &d));
  fsdp_unit_spec_t *copy;
  assert_int_equal(fsdp_unit_spec_copy(&spec, &copy), 0);
  fsdp_unit_spec_cleanup(&spec);
  assert_null(spec.params);
  weight_shape[1] = 1024; /* the copy holds its own shapes and names */
  params[0].name = "other";
  assert_false(fsdp_unit_spec_diff(copy, &want.spec, &d));
  assert_string_equal(fsdp_unit_strategy_name(copy->strategy), "HYBRID_SHARD");
  assert_string_equal(fsdp_unit_dtype_name(copy->params[0].dtype), "DTYPE_BF16");
  fsdp_unit_spec_free(copy);
  fsdp_unit_spec_free(NULL);
  fsdp_unit_spec_cleanup(NULL);
  fsdp_unit_layout_cleanup(NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_layout_pads_to_a_multiple_of_the_shards),
      cmocka_unit_test(test_scalars_and_zero_size_parameters),
      cmocka_unit_test(test_per_param_pieces_are_torch_chunks),
      cmocka_unit_test(test_runs_follow_the_definition),
      cmocka_unit_test(test_plans_across_hosts),
      cmocka_unit_test(test_refusals_name_the_field_and_value),
      cmocka_unit_test(test_element_counts_that_overflow_are_refused),
      cmocka_unit_test(test_gradient_factors_within_bounds),
      cmocka_unit_test(test_diff_names_the_first_differing_field),
      cmocka_unit_test(test_dtype_defaults),
      cmocka_unit_test(test_spec_from_a_request_and_its_copy),
  };
  return cmocka_run_group_tests_name("unit_layout", tests, NULL, NULL);
}
