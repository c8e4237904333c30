/* The TCP ports' relay: HTTP/2 between a TCP client and gRPC, read frame by frame.
 *
 * gRPC 1.51 has no defence against HTTP/2 rapid reset: a client that opens a stream and
 * resets it at once, over and over, never counts against the concurrent-stream limit
 * (which gRPC also enforces only once the client has acknowledged its SETTINGS), and gRPC
 * makes a call of every such stream, faster than the daemon can answer them, so memory and
 * CPU grow without bound. Anyone on the host reaches the health port, and anyone on the
 * network a plaintext peer port (a token is checked per call, after gRPC has made the call),
 * so the daemon does not hand their connections to gRPC: each is relayed through a socket
 * pair, and the relay reads the 9-byte header of every frame both ways. It counts the
 * streams the client opens (HEADERS on a new stream id) and those that end (the server's
 * END_STREAM or RST_STREAM, or the client's RST_STREAM), and closes the connection when the
 * client holds more streams open than the endpoint allows or resets more than the port
 * allows within FSDP_RELAY_RESET_WINDOW_MS (fewer while the endpoint does not trust the
 * connection: fsdp_rpc_endpoint_connection_trusted). It reads from the client only once gRPC has taken what it
 * forwarded before, and the socket pair's buffers are small, so gRPC never holds more than
 * a few kilobytes of one connection that the relay has not judged.
 *
 * Loop thread only. A relay frees itself once both sockets are closed; fsdp_relay_close()
 * starts that from the outside. */
#ifndef FSDP_RELAY_H
#define FSDP_RELAY_H

#include <stdbool.h>
#include <stdint.h>

#include <uv.h>

#include "daemon/rpc/rpc_server.h"

#define FSDP_RELAY_RESET_WINDOW_MS 10000

/* A port's limits on each of its connections. Borrowed: they must outlive the relay. */
typedef struct fsdp_relay_limits {
  const char *port;     /* for messages: "health port" */
  unsigned max_streams; /* streams open at once */
  unsigned max_resets;  /* client resets within FSDP_RELAY_RESET_WINDOW_MS */
  /* The same for a connection the endpoint does not trust yet (no call with its token): a
   * peer's first call carries the token long before any deadline of it could pass. */
  unsigned max_resets_untrusted;
} fsdp_relay_limits_t;

typedef struct fsdp_relay fsdp_relay_t;

/* Called once when the relay has closed both its sockets, before it is freed. */
typedef void (*fsdp_relay_closed_fn)(fsdp_relay_t *relay, void *data);

/* Relays the connected, non-blocking TCP socket client_fd (ownership taken, whatever the
 * result) to endpoint, whose calls name the client by its address; a client passing the
 * limits is cut. */
int fsdp_relay_start(uv_loop_t *loop, int client_fd, fsdp_rpc_endpoint_t *endpoint,
                     const fsdp_relay_limits_t *limits, fsdp_relay_closed_fn closed, void *data,
                     fsdp_relay_t **ret_relay);

/* Closes both sockets (gRPC sees the end of its side and ends the connection's calls). */
void fsdp_relay_close(fsdp_relay_t *relay);
/* The closed callback will not be called: its data is going away. */
void fsdp_relay_forget(fsdp_relay_t *relay);

/* The descriptor gRPC serves the connection on: the endpoint counts its calls under it. */
int fsdp_relay_served_fd(const fsdp_relay_t *relay);

/* The client's address, as gRPC names one ("ipv4:127.0.0.1:41234"). */
const char *fsdp_relay_client_name(const fsdp_relay_t *relay);

#endif
