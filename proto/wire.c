/* Wire codec between protobuf-c messages and gRPC byte buffers, plus the status table. */
#include "proto/wire.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <fsdp/fsdp_error.h>

#include "fsdp/v1/operator.pb-c.h"
#include "fsdp/v1/trainer.pb-c.h"

int fsdp_wire_method_path(const ProtobufCServiceDescriptor *service, unsigned method, char *buf,
                          size_t size) {
  if (method >= service->n_methods)
    return -EINVAL;
  int n = snprintf(buf, size, "/%s/%s", service->name, service->methods[method].name);
  return n < 0 || (size_t)n >= size ? -ENAMETOOLONG : 0;
}

bool fsdp_wire_method_is_server_streaming(const ProtobufCServiceDescriptor *service,
                                          unsigned method) {
  static const char *const streaming[] = {"/grpc.health.v1.Health/Watch"};
  char path[FSDP_WIRE_PATH_MAX];
  if (fsdp_wire_method_path(service, method, path, sizeof path) < 0)
    return false;
  for (size_t i = 0; i < sizeof streaming / sizeof streaming[0]; i++)
    if (strcmp(path, streaming[i]) == 0)
      return true;
  return false;
}

/* Methods whose requests may be as large as rpc.max_message_size allows: they carry a list
 * of the trainer's parameters or units. A health request is a name. Every other request is
 * a few ids and names. */
static const struct {
  const char *path;
  size_t max; /* 0: the configured maximum */
} request_limits[] = {
    {"/fsdp.v1.Trainer/RegisterUnit", 0},
    {"/fsdp.v1.Trainer/SetSchedule", 0},
    {"/fsdp.v1.Trainer/SetOptimizer", 0},
    {"/grpc.health.v1.Health/Check", FSDP_WIRE_HEALTH_REQUEST_MAX},
    {"/grpc.health.v1.Health/Watch", FSDP_WIRE_HEALTH_REQUEST_MAX},
};

size_t fsdp_wire_method_max_request(const ProtobufCServiceDescriptor *service, unsigned method,
                                    size_t max_message_size) {
  char path[FSDP_WIRE_PATH_MAX];
  size_t max = FSDP_WIRE_SMALL_REQUEST_MAX;
  if (fsdp_wire_method_path(service, method, path, sizeof path) == 0)
    for (size_t i = 0; i < sizeof request_limits / sizeof request_limits[0]; i++)
      if (strcmp(path, request_limits[i].path) == 0)
        max = request_limits[i].max ? request_limits[i].max : max_message_size;
  return max < max_message_size ? max : max_message_size;
}

int fsdp_wire_encode(const ProtobufCMessage *msg, grpc_byte_buffer **ret_buffer) {
  size_t len = protobuf_c_message_get_packed_size(msg);
  grpc_slice slice = grpc_slice_malloc(len);
  protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(slice));
  grpc_byte_buffer *buffer = grpc_raw_byte_buffer_create(&slice, 1);
  grpc_slice_unref(slice);
  if (!buffer)
    return -ENOMEM;
  *ret_buffer = buffer;
  return 0;
}

/* Reads a varint at data[0..len); returns its size, or 0 if it does not end in time. */
static size_t read_varint(const uint8_t *data, size_t len, uint64_t *ret_value) {
  uint64_t value = 0;
  for (size_t i = 0; i < len && i < 10; i++) {
    value |= (uint64_t)(data[i] & 0x7f) << (7 * i);
    if (!(data[i] & 0x80)) {
      *ret_value = value;
      return i + 1;
    }
  }
  return 0;
}

/* One field as the wire bytes hold it. */
typedef struct wire_field {
  const ProtobufCFieldDescriptor *desc; /* NULL: a field the message does not know */
  unsigned number;
  unsigned index; /* of a repeated field: which element this is */
  unsigned wire_type;
  const uint8_t *value; /* wire type 2 (length-delimited) only */
  size_t size;
} wire_field_t;

typedef int (*wire_visit_fn)(const wire_field_t *field, const char *prefix, void *ctx,
                             fsdp_status_t *st);

/* Calls visit for every field of the message of type desc in data[0..len), in wire order.
 * Bytes that do not parse end the walk quietly: protobuf-c refuses them when it unpacks. */
static int walk_fields(const ProtobufCMessageDescriptor *desc, const uint8_t *data, size_t len,
                       const char *prefix, wire_visit_fn visit, void *ctx, fsdp_status_t *st) {
  unsigned seen[64] = {0}; /* occurrences per field, for the index of repeated fields */
  size_t pos = 0;
  while (pos < len) {
    uint64_t key, size = 0;
    size_t n = read_varint(data + pos, len - pos, &key);
    if (n == 0)
      return 0;
    pos += n;
    wire_field_t field = {.number = (unsigned)(key >> 3), .wire_type = (unsigned)(key & 7)};
    switch (field.wire_type) {
    case 0:
      n = read_varint(data + pos, len - pos, &size);
      if (n == 0)
        return 0;
      pos += n;
      break;
    case 1:
    case 5:
      n = field.wire_type == 1 ? 8 : 4;
      if (n > len - pos)
        return 0;
      pos += n;
      break;
    case 2:
      n = read_varint(data + pos, len - pos, &size);
      if (n == 0 || size > len - pos - n)
        return 0;
      pos += n;
      field.value = data + pos;
      field.size = (size_t)size;
      pos += size;
      break;
    default:
      return 0;
    }
    field.desc = key >> 32 ? NULL : protobuf_c_message_descriptor_get_field(desc, field.number);
    size_t i = field.desc ? (size_t)(field.desc - desc->fields) : 64;
    if (field.desc && field.desc->label == PROTOBUF_C_LABEL_REPEATED && i < 64)
      field.index = seen[i]++;
    int r = visit(&field, prefix, ctx, st);
    if (r < 0)
      return r;
  }
  return 0;
}

/* "params[3].name", or "#15" for a field the message does not know. */
static void field_path(char *buf, size_t size, const char *prefix, const wire_field_t *field) {
  const char *dot = *prefix ? "." : "";
  if (!field->desc)
    snprintf(buf, size, "%s%s#%u", prefix, dot, field->number);
  else if (field->desc->label == PROTOBUF_C_LABEL_REPEATED)
    snprintf(buf, size, "%s%s%s[%u]", prefix, dot, field->desc->name, field->index);
  else
    snprintf(buf, size, "%s%s%s", prefix, dot, field->desc->name);
}

/* protobuf-c hands strings out as C strings, so a NUL inside one would silently cut it
 * short ("a\0b" would read as "a"). Only the wire bytes show it: this looks at them, down
 * into sub-messages, for string fields holding a NUL. */
static int visit_nul_in_strings(const wire_field_t *field, const char *prefix, void *ctx,
                                fsdp_status_t *st) {
  const ProtobufCFieldDescriptor *f = field->desc;
  if (!f || field->wire_type != 2 ||
      (f->type != PROTOBUF_C_TYPE_STRING && f->type != PROTOBUF_C_TYPE_MESSAGE))
    return 0;
  char path[256];
  field_path(path, sizeof path, prefix, field);
  if (f->type == PROTOBUF_C_TYPE_MESSAGE)
    return walk_fields(f->descriptor, field->value, field->size, path, visit_nul_in_strings, ctx,
                       st);
  const uint8_t *nul = memchr(field->value, 0, field->size);
  if (nul)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT, "field '%s' holds a NUL byte at offset %zu",
                           path, (size_t)(nul - field->value));
  return 0;
}

typedef struct field_count {
  const char *request;
  unsigned n;
  unsigned max;
} field_count_t;

unsigned fsdp_wire_request_max_fields(const ProtobufCMessageDescriptor *desc) {
  if (desc == &fsdp__v1__register_unit_request__descriptor)
    return FSDP_WIRE_REGISTER_UNIT_MAX_FIELDS;
  if (desc == &fsdp__v1__trace_reply__descriptor)
    return FSDP_WIRE_TRACE_MAX_FIELDS;
  return FSDP_WIRE_MAX_FIELDS;
}

/* protobuf-c allocates on its own every element of a repeated message, string or bytes
 * field, and every field the message does not know, and one 16 MiB request can hold
 * millions of empty ones (seconds of loop time, a GB of memory). So every field of a
 * request, at every level, is counted in the wire bytes first; the walk stops at the limit,
 * so it costs little whatever the size. */
static int visit_count_fields(const wire_field_t *field, const char *prefix, void *ctx,
                              fsdp_status_t *st) {
  field_count_t *count = ctx;
  bool message = field->desc && field->desc->type == PROTOBUF_C_TYPE_MESSAGE &&
                 field->wire_type == 2;
  if (++count->n <= count->max && !message)
    return 0;
  char path[256];
  field_path(path, sizeof path, prefix, field);
  if (count->n > count->max)
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED,
                           "field '%s': %s holds more than %u fields (each element of a list "
                           "counts, at every level), the most one may",
                           path, count->request, count->max);
  return walk_fields(field->desc->descriptor, field->value, field->size, path, visit_count_fields,
                     ctx, st);
}

int fsdp_wire_decode_bytes(const ProtobufCMessageDescriptor *desc, const uint8_t *data,
                           size_t len, ProtobufCMessage **ret_msg, fsdp_status_t *st) {
  ProtobufCMessage *msg = protobuf_c_message_unpack(desc, NULL, len, data);
  if (!msg)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "malformed %s: %zu bytes do not decode as this message", desc->name,
                           len);
  int r = fsdp_wire_validate(msg, st);
  if (r == 0)
    r = walk_fields(desc, data, len, "", visit_nul_in_strings, NULL, st);
  if (r < 0) {
    protobuf_c_message_free_unpacked(msg, NULL);
    return r;
  }
  *ret_msg = msg;
  return 0;
}

int fsdp_wire_decode_request_bytes(const ProtobufCMessageDescriptor *desc, const uint8_t *data,
                                   size_t len, ProtobufCMessage **ret_msg, fsdp_status_t *st) {
  field_count_t count = {.request = desc->name, .max = fsdp_wire_request_max_fields(desc)};
  int r = walk_fields(desc, data, len, "", visit_count_fields, &count, st);
  return r < 0 ? r : fsdp_wire_decode_bytes(desc, data, len, ret_msg, st);
}

static int decode_buffer(const ProtobufCMessageDescriptor *desc, grpc_byte_buffer *buffer,
                         bool request, ProtobufCMessage **ret_msg, fsdp_status_t *st) {
  if (!buffer)
    return fsdp_wire_decode_bytes(desc, NULL, 0, ret_msg, st);
  grpc_byte_buffer_reader reader;
  if (!grpc_byte_buffer_reader_init(&reader, buffer))
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT, "%s: payload could not be decompressed",
                           desc->name);
  grpc_slice all = grpc_byte_buffer_reader_readall(&reader);
  grpc_byte_buffer_reader_destroy(&reader);
  int r = (request ? fsdp_wire_decode_request_bytes : fsdp_wire_decode_bytes)(
      desc, GRPC_SLICE_START_PTR(all), GRPC_SLICE_LENGTH(all), ret_msg, st);
  grpc_slice_unref(all);
  return r;
}

int fsdp_wire_decode(const ProtobufCMessageDescriptor *desc, grpc_byte_buffer *buffer,
                     ProtobufCMessage **ret_msg, fsdp_status_t *st) {
  return decode_buffer(desc, buffer, false, ret_msg, st);
}

int fsdp_wire_decode_request(const ProtobufCMessageDescriptor *desc, grpc_byte_buffer *buffer,
                             ProtobufCMessage **ret_msg, fsdp_status_t *st) {
  return decode_buffer(desc, buffer, true, ret_msg, st);
}

int fsdp_wire_frame_encode(const ProtobufCMessage *msg, uint8_t *frame) {
  size_t len = protobuf_c_message_get_packed_size(msg);
  if (len > FSDP_CHANNEL_FRAME_BYTES - 4)
    return -EMSGSIZE;
  memset(frame, 0, FSDP_CHANNEL_FRAME_BYTES);
  for (int i = 0; i < 4; i++)
    frame[i] = (uint8_t)(len >> (8 * i));
  protobuf_c_message_pack(msg, frame + 4);
  return 0;
}

int fsdp_wire_frame_decode(const ProtobufCMessageDescriptor *desc, const uint8_t *frame,
                           size_t len, ProtobufCMessage **ret_msg, fsdp_status_t *st) {
  if (len != FSDP_CHANNEL_FRAME_BYTES)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "%s frame of %zu bytes, expected %d", desc->name, len,
                           FSDP_CHANNEL_FRAME_BYTES);
  uint32_t n = (uint32_t)frame[0] | (uint32_t)frame[1] << 8 | (uint32_t)frame[2] << 16 |
               (uint32_t)frame[3] << 24;
  if (n > FSDP_CHANNEL_FRAME_BYTES - 4)
    return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT,
                           "%s frame says %u bytes, more than the %d a frame holds", desc->name,
                           n, FSDP_CHANNEL_FRAME_BYTES - 4);
  return fsdp_wire_decode_bytes(desc, frame + 4, n, ret_msg, st);
}

/* Strict UTF-8 (RFC 3629): no overlong forms, no surrogates, nothing above U+10FFFF. */
static bool utf8_valid(const unsigned char *s) {
  while (*s) {
    unsigned char c = *s++;
    if (c < 0x80)
      continue;
    unsigned need;
    unsigned long cp;
    if (c >= 0xC2 && c <= 0xDF) {
      need = 1, cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      need = 2, cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      need = 3, cp = c & 0x07;
    } else {
      return false;
    }
    for (unsigned i = 0; i < need; i++, s++) {
      if ((*s & 0xC0) != 0x80)
        return false;
      cp = (cp << 6) | (*s & 0x3F);
    }
    if ((need == 2 && cp < 0x800) || (need == 3 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
  }
  return true;
}

static int validate_message(const ProtobufCMessage *msg, const char *prefix, fsdp_status_t *st);

static int validate_value(const ProtobufCFieldDescriptor *f, const void *value, const char *path,
                          fsdp_status_t *st) {
  switch (f->type) {
  case PROTOBUF_C_TYPE_ENUM: {
    int v = *(const int *)value;
    const ProtobufCEnumDescriptor *ed = f->descriptor;
    if (!protobuf_c_enum_descriptor_get_value(ed, v))
      return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT, "field '%s' = %d is not a value of %s",
                             path, v, ed->name);
    return 0;
  }
  case PROTOBUF_C_TYPE_STRING: {
    const char *s = *(char *const *)value;
    if (s && !utf8_valid((const unsigned char *)s))
      return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT, "field '%s' is not valid UTF-8", path);
    return 0;
  }
  case PROTOBUF_C_TYPE_MESSAGE: {
    const ProtobufCMessage *sub = *(ProtobufCMessage *const *)value;
    return sub ? validate_message(sub, path, st) : 0;
  }
  default:
    return 0;
  }
}

static size_t value_size(const ProtobufCFieldDescriptor *f) {
  switch (f->type) {
  case PROTOBUF_C_TYPE_ENUM:
    return sizeof(int);
  case PROTOBUF_C_TYPE_STRING:
    return sizeof(char *);
  case PROTOBUF_C_TYPE_MESSAGE:
    return sizeof(ProtobufCMessage *);
  default:
    return 0;
  }
}

static int validate_message(const ProtobufCMessage *msg, const char *prefix, fsdp_status_t *st) {
  const ProtobufCMessageDescriptor *desc = msg->descriptor;
  /* protobuf-c lets field number 0 through when its tag is encoded in more bytes than
   * needed; the format forbids it, and the message would not decode again once re-encoded. */
  for (unsigned i = 0; i < msg->n_unknown_fields; i++)
    if (msg->unknown_fields[i].tag == 0)
      return fsdp_status_set(st, FSDP_E_INVALID_ARGUMENT, "%s%s%s: field number 0 is not valid",
                             desc->name, *prefix ? " at " : "", prefix);
  for (unsigned i = 0; i < desc->n_fields; i++) {
    const ProtobufCFieldDescriptor *f = &desc->fields[i];
    size_t size = value_size(f);
    if (size == 0)
      continue; /* scalars and bytes: every bit pattern is valid */
    const char *base = (const char *)msg;
    char path[256];
    if (f->label == PROTOBUF_C_LABEL_REPEATED) {
      size_t n = *(const size_t *)(base + f->quantifier_offset);
      const char *array = *(char *const *)(base + f->offset);
      for (size_t k = 0; k < n; k++) {
        snprintf(path, sizeof path, "%s%s%s[%zu]", prefix, *prefix ? "." : "", f->name, k);
        int r = validate_value(f, array + k * size, path, st);
        if (r < 0)
          return r;
      }
      continue;
    }
    if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
        *(const uint32_t *)(base + f->quantifier_offset) != f->id)
      continue; /* another member of the oneof is set */
    snprintf(path, sizeof path, "%s%s%s", prefix, *prefix ? "." : "", f->name);
    int r = validate_value(f, base + f->offset, path, st);
    if (r < 0)
      return r;
  }
  return 0;
}

int fsdp_wire_validate(const ProtobufCMessage *msg, fsdp_status_t *st) {
  return validate_message(msg, "", st);
}

/* The one table between fsdp error codes and gRPC status codes. Where several errors share
 * a status, the first row is the one a client gets back from that status. */
static const struct {
  int error;
  grpc_status_code status;
} status_table[] = {
    {FSDP_E_CANCELLED, GRPC_STATUS_CANCELLED},
    {FSDP_E_UNKNOWN, GRPC_STATUS_UNKNOWN},
    {FSDP_E_INVALID_ARGUMENT, GRPC_STATUS_INVALID_ARGUMENT},
    {FSDP_E_DEADLINE_EXCEEDED, GRPC_STATUS_DEADLINE_EXCEEDED},
    {FSDP_E_NOT_FOUND, GRPC_STATUS_NOT_FOUND},
    {FSDP_E_ALREADY_EXISTS, GRPC_STATUS_ALREADY_EXISTS},
    {FSDP_E_PERMISSION_DENIED, GRPC_STATUS_PERMISSION_DENIED},
    {FSDP_E_RESOURCE_EXHAUSTED, GRPC_STATUS_RESOURCE_EXHAUSTED},
    {FSDP_E_FAILED_PRECONDITION, GRPC_STATUS_FAILED_PRECONDITION},
    {FSDP_E_ABORTED, GRPC_STATUS_ABORTED},
    {FSDP_E_OUT_OF_RANGE, GRPC_STATUS_OUT_OF_RANGE},
    {FSDP_E_UNIMPLEMENTED, GRPC_STATUS_UNIMPLEMENTED},
    {FSDP_E_INTERNAL, GRPC_STATUS_INTERNAL},
    {FSDP_E_UNAVAILABLE, GRPC_STATUS_UNAVAILABLE},
    {FSDP_E_DATA_LOSS, GRPC_STATUS_DATA_LOSS},
    {FSDP_E_UNAUTHENTICATED, GRPC_STATUS_UNAUTHENTICATED},
    {FSDP_E_PROTOCOL_VERSION, GRPC_STATUS_FAILED_PRECONDITION},
    {FSDP_E_CONFIG, GRPC_STATUS_INVALID_ARGUMENT},
    {-EINVAL, GRPC_STATUS_INVALID_ARGUMENT},
    {-ERANGE, GRPC_STATUS_OUT_OF_RANGE},
    {-EOVERFLOW, GRPC_STATUS_OUT_OF_RANGE},
    {-ENOENT, GRPC_STATUS_NOT_FOUND},
    {-EEXIST, GRPC_STATUS_ALREADY_EXISTS},
    {-EPERM, GRPC_STATUS_PERMISSION_DENIED},
    {-EACCES, GRPC_STATUS_PERMISSION_DENIED},
    {-ENOMEM, GRPC_STATUS_RESOURCE_EXHAUSTED},
    {-ENOSPC, GRPC_STATUS_RESOURCE_EXHAUSTED},
    {-EMFILE, GRPC_STATUS_RESOURCE_EXHAUSTED},
    {-ETIMEDOUT, GRPC_STATUS_DEADLINE_EXCEEDED},
    {-ECANCELED, GRPC_STATUS_CANCELLED},
    {-ENOSYS, GRPC_STATUS_UNIMPLEMENTED},
    {-EAGAIN, GRPC_STATUS_UNAVAILABLE},
    {-ECONNREFUSED, GRPC_STATUS_UNAVAILABLE},
    {-ECONNRESET, GRPC_STATUS_UNAVAILABLE},
};

grpc_status_code fsdp_wire_status_from_error(int err) {
  if (err >= 0)
    return GRPC_STATUS_OK;
  for (size_t i = 0; i < sizeof status_table / sizeof status_table[0]; i++)
    if (status_table[i].error == err)
      return status_table[i].status;
  return GRPC_STATUS_INTERNAL;
}

int fsdp_wire_error_from_status(grpc_status_code code) {
  if (code == GRPC_STATUS_OK)
    return 0;
  for (size_t i = 0; i < sizeof status_table / sizeof status_table[0]; i++)
    if (status_table[i].status == code)
      return status_table[i].error;
  return FSDP_E_UNKNOWN;
}

const char *fsdp_wire_status_name(grpc_status_code code) {
  static const char *const names[] = {
      "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
      "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
      "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
      "UNAUTHENTICATED"};
  return (unsigned)code < sizeof names / sizeof names[0] ? names[code] : "UNKNOWN";
}

const char *fsdp_error_status_name(int err) {
  return fsdp_wire_status_name(fsdp_wire_status_from_error(err));
}

const char *fsdp_wire_peer_state_name(int state) {
  static const char prefix[] = "PEER_STATE_";
  const ProtobufCEnumValue *v =
      protobuf_c_enum_descriptor_get_value(&fsdp__v1__peer_state__descriptor, state);
  if (!v || strncmp(v->name, prefix, sizeof prefix - 1) != 0)
    return "UNSPECIFIED";
  return v->name + sizeof prefix - 1;
}
