/* A listening TCP socket on "HOST:PORT" ("[::1]:0" for IPv6; an empty host: every address;
 * port 0 picks one), non-blocking and close-on-exec, with SO_REUSEADDR only: without
 * SO_REUSEPORT a second process cannot share the port. Any thread. */
#ifndef FSDP_COMMON_TCP_LISTEN_H
#define FSDP_COMMON_TCP_LISTEN_H

#include <stddef.h>

#include "common/status.h"

/* The socket in *ret_fd and the address it is bound to ("HOST:PORT", the port the one
 * picked) in ret_address (size bytes). `what` names the endpoint in messages (st:
 * INVALID_ARGUMENT for an address that is not HOST:PORT or does not resolve, -errno when
 * the socket cannot listen). */
int fsdp_tcp_listen(const char *address, const char *what, int *ret_fd, char *ret_address,
                    size_t size, fsdp_status_t *st);

#endif
