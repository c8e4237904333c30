/* A listening TCP socket (common/tcp_listen.h). */
#include "common/tcp_listen.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

int fsdp_tcp_listen(const char *address, const char *what, int *ret_fd, char *ret_address,
                    size_t size, fsdp_status_t *st) {
  char host[256];
  const char *colon = strrchr(address, ':');
  if (!colon || (size_t)(colon - address) >= sizeof host)
    return fsdp_status_set(st, -EINVAL, "%s address '%s' is not HOST:PORT", what, address);
  snprintf(host, sizeof host, "%.*s", (int)(colon - address), address);
  if (host[0] == '[' && host[strlen(host) - 1] == ']') {
    memmove(host, host + 1, strlen(host));
    host[strlen(host) - 1] = '\0';
  }
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_PASSIVE | AI_NUMERICSERV},
                  *ai;
  int r = getaddrinfo(host[0] ? host : NULL, colon + 1, &hints, &ai);
  if (r != 0)
    return fsdp_status_set(st, -EINVAL, "%s address '%s': %s", what, address, gai_strerror(r));
  int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  int one = 1;
  if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) < 0 ||
      bind(fd, ai->ai_addr, ai->ai_addrlen) < 0 || listen(fd, SOMAXCONN) < 0) {
    int err = errno;
    if (fd >= 0)
      close(fd);
    freeaddrinfo(ai);
    return fsdp_status_set(st, -err, "cannot listen on %s for the %s endpoint: %s", address,
                           what, strerror(err));
  }
  freeaddrinfo(ai);
  struct sockaddr_storage bound;
  socklen_t len = sizeof bound;
  getsockname(fd, (struct sockaddr *)&bound, &len);
  snprintf(ret_address, size, "%.*s:%u", (int)(colon - address), address,
           ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                            : ((struct sockaddr_in *)&bound)->sin_port));
  *ret_fd = fd;
  return 0;
}
