/* Default socket path (endpoint.h). */
#include "endpoint.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/un.h>

int zd__socket_default_path(char *buf, size_t len) {
  const char *xdg = getenv("XDG_RUNTIME_DIR");
  int n = (xdg && xdg[0]) ? snprintf(buf, len, "%s/zerod.sock", xdg)
                          : snprintf(buf, len, "/run/zerod/zerod.sock");
  if (n < 0 || (size_t)n >= len || (size_t)n >= sizeof(((struct sockaddr_un *)0)->sun_path))
    return -ENAMETOOLONG;
  return 0;
}
