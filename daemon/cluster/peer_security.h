/* The secrets of the Peer endpoint: the token and the TLS certificates that the peer.* keys
 * name, read once at start. Apart from the peer table because the daemon hands them to two
 * owners, the Peer server's endpoint and the table's client, and because reading files of
 * secrets (size cap, one-line token, wiped on free) is a job of its own.
 *
 * Threads: any, but the daemon reads them at start, before the loop runs. Lifetime: the
 * caller owns what fsdp_peer_security_load fills, and fsdp_peer_security_cleanup wipes and
 * frees it; whoever borrows it (the endpoint, the peer table) must be gone first. */
#ifndef FSDP_PEER_SECURITY_H
#define FSDP_PEER_SECURITY_H

#include "common/status.h"
#include "config/config.h"

/* The secrets of the Peer endpoint, read from the files config names (at start, before the
 * loop runs). Owned; fsdp_peer_security_cleanup wipes and frees them. */
typedef struct fsdp_peer_security {
  char *token;                        /* NULL: no token */
  char *tls_cert, *tls_key, *tls_ca; /* PEM text; all NULL: plaintext */
} fsdp_peer_security_t;

int fsdp_peer_security_load(const fsdp_config_t *cfg, fsdp_peer_security_t *ret,
                            fsdp_status_t *st);
void fsdp_peer_security_cleanup(fsdp_peer_security_t *sec);

/* Wipes and frees a secret string (one made from a secret, like the token's "Bearer"
 * header, too) and sets *s to NULL. NULL-safe. */
void fsdp_peer_secret_free(char **s);

#endif
