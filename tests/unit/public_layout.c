/* What the Python package mirrors of the public headers in ctypes (python/fsdpd/_lib.py), as
 * this compiler sees it: the layout of every struct it mirrors, and for every function it
 * declares the width of the return value and the number of parameters. Printed as JSON for
 * test_python_mirrors.py, which holds the mirrors to it. A mirror that nothing checks drifts
 * silently: ctypes then reads and writes the wrong bytes, or truncates a returned pointer.
 *
 * Each struct's fields are listed once, in the header's order: F for a scalar or a pointer,
 * A for an array. The list also builds a positional initializer of the struct, and a missing
 * initializer is an error in this file, so the build fails when the header gains a field that
 * the list lacks: the JSON then names every field the header has. Each function is listed with
 * a zero for each parameter, and a call with another count than the prototype's does not
 * compile. The constants the package passes as plain numbers are printed with their values. */
#include <stddef.h>
#include <stdio.h>

#include <fsdp/fsdp_client.h>
#include <fsdp/fsdp_trainer.h>

#pragma GCC diagnostic error "-Wmissing-field-initializers"

#define CLIENT_OPTIONS(F, A) F(timeout_ms) F(max_message_bytes) F(wait_for_ready)
#define TRAINER_OPTIONS(F, A)                                                                 \
  F(job) F(local_rank) F(local_world_size) F(generation) F(job_token) F(world_size)           \
  F(node_rank)
#define PARAM_DESC(F, A) F(name) F(shape) F(ndim) F(requires_grad)
#define UNIT_DESC(F, A)                                                                       \
  F(name) F(params) F(n_params) F(strategy) F(param_type) F(reduce_type)                      \
  F(gradient_predivide_factor) F(gradient_postdivide_factor) F(scratch) F(layout)
#define UNIT_VIEW(F, A)                                                                       \
  F(numel) F(padded_numel) F(shard_numel) F(shard) F(param_offsets) F(n_params) F(unsharded)  \
  F(master) F(grad) F(host_first_shard) F(host_shards) F(full_grad) F(gathered_step)          \
  F(reduced_step) F(replica) F(optimizer_steps) A(optimizer_state) F(optimizer_arrays)        \
  F(layout) F(param_shard_offsets) F(param_rows_per_shard)
#define UNIT_SCHEDULE(F, A) F(unit) F(reshard_after_forward)
#define SCHEDULE(F, A)                                                                        \
  F(max_inflight) F(units) F(n_units) F(forward_order) F(n_forward_order)                     \
  F(forward_prefetch) F(backward_prefetch)
#define PARAM_GROUP(F, A)                                                                     \
  F(params) F(n_params) F(lr) F(weight_decay) F(maximize) F(beta1) F(beta2) F(eps) F(amsgrad) \
  F(momentum) F(dampening) F(nesterov)
#define OPTIM(F, A) F(kind) F(groups) F(n_groups) F(max_grad_norm)

#define ZERO(field) 0,
#define ZERO_ARRAY(field) {0},
#define PRINT_FIELD(field)                                                                    \
  printf("%s[\"%s\", %zu, %zu]", field_sep, #field, offsetof(type_t, field),                  \
         sizeof(probe.field));                                                                \
  field_sep = ", ";

/* "<type>": {"size": N, "fields": [["<name>", offset, size], ...]} */
#define PRINT_STRUCT(type, FIELDS)                                                            \
  do {                                                                                        \
    typedef type type_t;                                                                      \
    const type_t probe = {FIELDS(ZERO, ZERO_ARRAY)};                                          \
    const char *field_sep = "";                                                               \
    printf("%s    \"%s\": {\"size\": %zu, \"fields\": [", sep, #type, sizeof(type_t));        \
    FIELDS(PRINT_FIELD, PRINT_FIELD)                                                          \
    printf("]}");                                                                             \
    sep = ",\n";                                                                              \
  } while (0)

/* "<name>": [return width, parameters], from a call with a zero for every parameter, which
 * the compiler checks against the prototype but never evaluates. VOID_FUNCTION: width 0. */
#define PRINT_CALL(name, width, ...)                                                          \
  do {                                                                                        \
    printf("%s    \"%s\": [%zu, %zu]", sep, #name, (size_t)(width),                            \
           sizeof((int[]){__VA_ARGS__}) / sizeof(int));                                       \
    sep = ",\n";                                                                              \
  } while (0)
#define PRINT_FUNCTION(name, ...) PRINT_CALL(name, sizeof(name(__VA_ARGS__)), __VA_ARGS__)
#define PRINT_VOID_FUNCTION(name, ...)                                                        \
  PRINT_CALL(name, sizeof((name(__VA_ARGS__), 0)) * 0, __VA_ARGS__)

/* "<NAME>": value */
#define PRINT_CONSTANT(name)                                                                  \
  do {                                                                                        \
    printf("%s    \"%s\": %lld", sep, #name, (long long)(name));                               \
    sep = ",\n";                                                                              \
  } while (0)

int main(void) {
  const char *sep = "";
  printf("{\n  \"structs\": {\n");
  PRINT_STRUCT(fsdp_client_options_t, CLIENT_OPTIONS);
  PRINT_STRUCT(fsdp_trainer_options_t, TRAINER_OPTIONS);
  PRINT_STRUCT(fsdp_param_desc_t, PARAM_DESC);
  PRINT_STRUCT(fsdp_unit_desc_t, UNIT_DESC);
  PRINT_STRUCT(fsdp_unit_view_t, UNIT_VIEW);
  PRINT_STRUCT(fsdp_unit_schedule_t, UNIT_SCHEDULE);
  PRINT_STRUCT(fsdp_schedule_t, SCHEDULE);
  PRINT_STRUCT(fsdp_param_group_t, PARAM_GROUP);
  PRINT_STRUCT(fsdp_optim_t, OPTIM);
  sep = "";
  printf("\n  },\n  \"functions\": {\n");
  PRINT_FUNCTION(fsdp_strerror, 0);
  PRINT_FUNCTION(fsdp_error_name, 0);
  PRINT_FUNCTION(fsdp_error_status_name, 0);
  PRINT_FUNCTION(fsdp_client_connect, 0, 0, 0);
  PRINT_VOID_FUNCTION(fsdp_client_close, 0);
  PRINT_FUNCTION(fsdp_client_last_error, 0);
  PRINT_FUNCTION(fsdp_trainer_attach, 0, 0, 0);
  PRINT_FUNCTION(fsdp_trainer_detach, 0);
  PRINT_FUNCTION(fsdp_trainer_session_id, 0);
  PRINT_FUNCTION(fsdp_trainer_keepalive, 0);
  PRINT_FUNCTION(fsdp_trainer_register_unit, 0, 0, 0);
  PRINT_FUNCTION(fsdp_unit_view, 0);
  PRINT_FUNCTION(fsdp_trainer_memory_device, 0);
  PRINT_FUNCTION(fsdp_trainer_set_cuda_stream, 0, 0);
  PRINT_FUNCTION(fsdp_trainer_unshard, 0, 0, 0, 0);
  PRINT_FUNCTION(fsdp_trainer_unshard_start, 0, 0, 0, 0);
  PRINT_FUNCTION(fsdp_trainer_wait, 0, 0, 0);
  PRINT_FUNCTION(fsdp_trainer_set_schedule, 0, 0);
  PRINT_FUNCTION(fsdp_trainer_set_optimizer, 0, 0);
  PRINT_FUNCTION(fsdp_trainer_save_checkpoint, 0, 0, 0, 0);
  PRINT_FUNCTION(fsdp_trainer_load_checkpoint, 0, 0, 0);
  PRINT_FUNCTION(fsdp_trainer_reshard, 0, 0, 0);
  PRINT_FUNCTION(fsdp_trainer_reduce_scatter, 0, 0, 0, 0);
  PRINT_FUNCTION(fsdp_trainer_reduce_scatter_start, 0, 0, 0, 0);
  sep = "";
  printf("\n  },\n  \"constants\": {\n");
  PRINT_CONSTANT(FSDP_SCALAR_DEFAULT);
  PRINT_CONSTANT(FSDP_SCALAR_FP32);
  PRINT_CONSTANT(FSDP_SCALAR_BF16);
  PRINT_CONSTANT(FSDP_SCALAR_FP16);
  PRINT_CONSTANT(FSDP_PASS_FORWARD);
  PRINT_CONSTANT(FSDP_PASS_BACKWARD);
  PRINT_CONSTANT(FSDP_REDUCE_ACCUMULATE);
  PRINT_CONSTANT(FSDP_REDUCE_DEFER_ALL_REDUCE);
  PRINT_CONSTANT(FSDP_REDUCE_STEP_OPTIMIZER);
  PRINT_CONSTANT(FSDP_REDUCE_STEP_ONLY);
  PRINT_CONSTANT(FSDP_LAYOUT_FLAT);
  PRINT_CONSTANT(FSDP_LAYOUT_PER_PARAM);
  printf("\n  }\n}\n");
  return 0;
}
