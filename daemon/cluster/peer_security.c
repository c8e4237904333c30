/* The Peer endpoint's secrets read from their files (see peer_security.h): a file is
 * capped in size, must be text, and the token one line; whatever was read is wiped before it
 * is freed, on failure too. */
#include "daemon/cluster/peer_security.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Secrets and certificates are small; the cap keeps a wrong path from eating memory. */
#define SECRET_FILE_MAX (256 * 1024)

static int read_secret_file(const char *key, const char *path, bool trim, char **ret,
                            fsdp_status_t *st) {
  char errbuf[128];
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY);
  if (fd < 0)
    return fsdp_status_set(st, FSDP_E_CONFIG, "key '%s': cannot read '%s': %s", key, path,
                           strerror_r(errno, errbuf, sizeof errbuf));
  /* Reads up to one byte past the limit, to tell a file that is too long, plus the NUL. */
  char *buf = malloc(SECRET_FILE_MAX + 2);
  size_t len = 0;
  ssize_t got = 0;
  while (buf && len <= SECRET_FILE_MAX &&
         (got = read(fd, buf + len, SECRET_FILE_MAX + 1 - len)) > 0)
    len += (size_t)got;
  int err = got < 0 ? errno : 0;
  close(fd);
  int r = 0;
  if (!buf)
    r = fsdp_status_set(st, -ENOMEM, "key '%s': out of memory reading '%s'", key, path);
  else if (err)
    r = fsdp_status_set(st, FSDP_E_CONFIG, "key '%s': cannot read '%s': %s", key, path,
                        strerror_r(err, errbuf, sizeof errbuf));
  else if (len > SECRET_FILE_MAX)
    r = fsdp_status_set(st, FSDP_E_CONFIG, "key '%s': '%s' is larger than %d bytes", key, path,
                        SECRET_FILE_MAX);
  if (r == 0) {
    buf[len] = '\0';
    if (trim)
      while (len > 0 && (buf[len - 1] == '\n' || buf[len - 1] == '\r' || buf[len - 1] == ' ' ||
                         buf[len - 1] == '\t'))
        buf[--len] = '\0';
    if (len == 0 || strlen(buf) != len)
      r = fsdp_status_set(st, FSDP_E_CONFIG, "key '%s': '%s' is %s", key, path,
                          len == 0 ? "empty" : "not text (it holds a NUL byte)");
    else if (trim && strpbrk(buf, "\r\n"))
      r = fsdp_status_set(st, FSDP_E_CONFIG,
                          "key '%s': '%s' holds more than one line; the token is one line",
                          key, path);
  }
  if (r < 0) {
    if (buf)
      explicit_bzero(buf, SECRET_FILE_MAX + 2);
    free(buf);
    return r;
  }
  *ret = buf;
  return 0;
}

void fsdp_peer_secret_free(char **s) {
  if (*s) {
    explicit_bzero(*s, strlen(*s));
    free(*s);
    *s = NULL;
  }
}

void fsdp_peer_security_cleanup(fsdp_peer_security_t *sec) {
  if (!sec)
    return;
  fsdp_peer_secret_free(&sec->token);
  fsdp_peer_secret_free(&sec->tls_cert);
  fsdp_peer_secret_free(&sec->tls_key);
  fsdp_peer_secret_free(&sec->tls_ca);
}

int fsdp_peer_security_load(const fsdp_config_t *cfg, fsdp_peer_security_t *ret,
                            fsdp_status_t *st) {
  fsdp_peer_security_t sec = {0};
  const char *token = fsdp_config_text(cfg, FSDP_OPTION_PEER_TOKEN_FILE);
  int r = 0;
  if (token[0] && (r = read_secret_file("peer.token_file", token, true, &sec.token, st)) < 0)
    goto fail;
  const char *cert = fsdp_config_text(cfg, FSDP_OPTION_PEER_TLS_CERT);
  if (cert[0]) {
    if ((r = read_secret_file("peer.tls_cert", cert, false, &sec.tls_cert, st)) < 0 ||
        (r = read_secret_file("peer.tls_key", fsdp_config_text(cfg, FSDP_OPTION_PEER_TLS_KEY),
                              false, &sec.tls_key, st)) < 0 ||
        (r = read_secret_file("peer.tls_ca", fsdp_config_text(cfg, FSDP_OPTION_PEER_TLS_CA),
                              false, &sec.tls_ca, st)) < 0)
      goto fail;
  }
  *ret = sec;
  return 0;
fail:
  fsdp_peer_security_cleanup(&sec);
  return r;
}
