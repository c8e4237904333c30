/* The metrics endpoint over libmicrohttpd, run on the loop (http.h). */
#include "daemon/metrics/http.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <microhttpd.h>

#include "common/log.h"
#include "common/tcp_listen.h"

/* Connections held at once, and how long an idle one is kept (seconds). */
#define METRICS_MAX_CONNECTIONS 16u
#define METRICS_CONNECTION_TIMEOUT_S 10u

struct fsdp_metrics_http {
  struct MHD_Daemon *mhd;
  uv_poll_t poll;   /* libmicrohttpd's epoll descriptor */
  uv_timer_t timer; /* its next timeout (idle connections) */
  unsigned closing; /* handles still to close */
  fsdp_metrics_render_fn render;
  fsdp_metrics_page_fn page;
  void *data;
  unsigned long scrapes;
};

/* Queues the answer: text of `type`, freed by libmicrohttpd with MUST_FREE (also when it
 * cannot be answered); a 405 says which methods are. */
static enum MHD_Result answer_text(struct MHD_Connection *c, unsigned code, const char *type,
                                   char *text, size_t len, enum MHD_ResponseMemoryMode mode) {
  struct MHD_Response *response = MHD_create_response_from_buffer(len, text, mode);
  if (!response) {
    if (mode == MHD_RESPMEM_MUST_FREE)
      free(text);
    return MHD_NO;
  }
  MHD_add_response_header(response, MHD_HTTP_HEADER_CONTENT_TYPE, type);
  /* Every answer is what it says it is; the page runs nothing and loads nothing (its style
   * is inline), whatever a name in it might say. */
  MHD_add_response_header(response, "X-Content-Type-Options", "nosniff");
  if (strncmp(type, "text/html", 9) == 0)
    MHD_add_response_header(response, "Content-Security-Policy",
                            "default-src 'none'; style-src 'unsafe-inline'");
  if (code == MHD_HTTP_METHOD_NOT_ALLOWED)
    MHD_add_response_header(response, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
  enum MHD_Result r = MHD_queue_response(c, code, response);
  MHD_destroy_response(response);
  return r;
}

static enum MHD_Result answer_plain(struct MHD_Connection *c, unsigned code, const char *text) {
  return answer_text(c, code, "text/plain; charset=utf-8", (char *)text, strlen(text),
                     MHD_RESPMEM_PERSISTENT);
}

/* The status page, written into a memory stream, answered as it is. */
static enum MHD_Result answer_page(struct MHD_Connection *c, fsdp_metrics_http_t *http) {
  char *text = NULL;
  size_t len = 0;
  FILE *out = open_memstream(&text, &len);
  if (!out)
    return answer_plain(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
  http->page(http->data, out);
  bool failed = ferror(out);
  if (fclose(out) != 0 || failed) {
    free(text);
    return answer_plain(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
  }
  return answer_text(c, MHD_HTTP_OK, "text/html; charset=utf-8", text, len,
                     MHD_RESPMEM_MUST_FREE);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version,
                                  const char *upload_data, size_t *upload_data_size,
                                  void **con_cls) {
  (void)version, (void)upload_data;
  fsdp_metrics_http_t *http = cls;
  if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0) {
    *upload_data_size = 0; /* a body is not read */
    return answer_plain(c, MHD_HTTP_METHOD_NOT_ALLOWED, "only GET\n");
  }
  if (!*con_cls) { /* the headers are in: answer at the next call, as libmicrohttpd asks */
    *con_cls = http;
    return MHD_YES;
  }
  if (strcmp(url, "/") == 0)
    return answer_page(c, http);
  if (strcmp(url, "/metrics") != 0)
    return answer_plain(c, MHD_HTTP_NOT_FOUND, "fsdpd serves / and /metrics\n");
  fsdp_exposition_t e;
  fsdp_exposition_init(&e);
  http->render(http->data, &e);
  if (e.failed || !e.text) {
    fsdp_exposition_cleanup(&e);
    return answer_plain(c, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
  }
  http->scrapes++;
  return answer_text(c, MHD_HTTP_OK, "text/plain; version=0.0.4; charset=utf-8", e.text, e.len,
                     MHD_RESPMEM_MUST_FREE);
}

static void on_timer(uv_timer_t *timer);

/* Runs libmicrohttpd's pending work, then arms the timer for its next timeout. */
static void run(fsdp_metrics_http_t *http) {
  MHD_run(http->mhd);
  MHD_UNSIGNED_LONG_LONG ms;
  if (MHD_get_timeout(http->mhd, &ms) == MHD_YES)
    uv_timer_start(&http->timer, on_timer, ms, 0);
  else
    uv_timer_stop(&http->timer);
}

static void on_timer(uv_timer_t *timer) {
  run(timer->data);
}

static void on_poll(uv_poll_t *poll, int status, int events) {
  (void)status, (void)events;
  run(poll->data);
}

int fsdp_metrics_http_start(uv_loop_t *loop, const char *address, fsdp_metrics_render_fn render,
                            fsdp_metrics_page_fn page,
                            void *data, fsdp_metrics_http_t **ret_http, char *ret_address,
                            size_t size, fsdp_status_t *st) {
  int fd;
  int r = fsdp_tcp_listen(address, "metrics", &fd, ret_address, size, st);
  if (r < 0)
    return r;
  fsdp_metrics_http_t *http = calloc(1, sizeof *http);
  if (!http) {
    close(fd);
    return fsdp_status_set(st, FSDP_E_RESOURCE_EXHAUSTED, "out of memory for the metrics port");
  }
  http->render = render;
  http->page = page;
  http->data = data;
  /* epoll without a thread of its own: the loop polls its descriptor and calls MHD_run. */
  http->mhd = MHD_start_daemon(MHD_USE_EPOLL, 0, NULL, NULL, on_request, http,
                               MHD_OPTION_LISTEN_SOCKET, fd,
                               MHD_OPTION_CONNECTION_LIMIT, METRICS_MAX_CONNECTIONS,
                               MHD_OPTION_CONNECTION_TIMEOUT, METRICS_CONNECTION_TIMEOUT_S,
                               MHD_OPTION_END);
  const union MHD_DaemonInfo *info =
      http->mhd ? MHD_get_daemon_info(http->mhd, MHD_DAEMON_INFO_EPOLL_FD) : NULL;
  if (!info || uv_poll_init(loop, &http->poll, info->epoll_fd) < 0) {
    if (http->mhd)
      MHD_stop_daemon(http->mhd);
    else
      close(fd);
    free(http);
    return fsdp_status_set(st, FSDP_E_INTERNAL, "cannot serve metrics on %s", ret_address);
  }
  uv_timer_init(loop, &http->timer);
  http->poll.data = http->timer.data = http;
  uv_poll_start(&http->poll, UV_READABLE, on_poll);
  run(http);
  *ret_http = http;
  return 0;
}

static void on_closed(uv_handle_t *handle) {
  fsdp_metrics_http_t *http = handle->data;
  if (--http->closing == 0)
    free(http);
}

void fsdp_metrics_http_stop(fsdp_metrics_http_t *http) {
  if (!http)
    return;
  /* The poll first: libuv lets go of the descriptor before libmicrohttpd closes it. */
  http->closing = 2;
  uv_close((uv_handle_t *)&http->poll, on_closed);
  uv_close((uv_handle_t *)&http->timer, on_closed);
  MHD_stop_daemon(http->mhd); /* closes the port and every connection */
  http->mhd = NULL;
}

unsigned long fsdp_metrics_http_scrapes(const fsdp_metrics_http_t *http) {
  return http ? http->scrapes : 0;
}
