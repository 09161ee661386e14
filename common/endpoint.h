/* Where the daemon's socket is when nobody says: shared by zerod's `socket` default and
 * libzerod's zd_connect(NULL, ...), so that both sides agree without configuration. */
#ifndef ZD_COMMON_ENDPOINT_H
#define ZD_COMMON_ENDPOINT_H

#include <stddef.h>

/* $XDG_RUNTIME_DIR/zerod.sock when XDG_RUNTIME_DIR is set, else /run/zerod/zerod.sock.
 * Returns 0, or -ENAMETOOLONG if it does not fit in len (or in a sockaddr_un). */
int zd__socket_default_path(char *buf, size_t len);

#endif /* ZD_COMMON_ENDPOINT_H */
