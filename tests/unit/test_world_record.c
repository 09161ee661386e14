/* Unit test of the world size record (daemon/world/world_record.c): a record written is read back
 * the same, the file is written atomically with mode 0600 (no temporary file left) and replaces
 * the one before, and malformed records are refused with a message that names the problem and the
 * form expected.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <dirent.h>

#include "check.h"
#include "world_record.h"

static void test_parse(void) {
  zd__world_record_t r = {0};
  zd__err_t err = {0};
  const char *ok = "world_size=2 from=4 step=17\n";
  CHECK_INT_EQ(zd__world_record_parse(ok, strlen(ok), "t", &r, &err), 0);
  CHECK_INT_EQ(r.world_size, 2);
  CHECK_INT_EQ(r.from, 4);
  CHECK_U64_EQ(r.step, 17);
  CHECK_INT_EQ(zd__world_record_parse(ok, strlen(ok) - 1, "t", &r, &err), 0); /* no newline */
  char buf[ZD__WORLD_RECORD_MAX];
  zd__world_record_t big = {.world_size = 65535, .from = 1, .step = UINT64_MAX}, back = {0};
  size_t n = zd__world_record_format(&big, buf, sizeof buf);
  CHECK_STR_EQ(buf, "world_size=65535 from=1 step=18446744073709551615\n");
  CHECK_INT_EQ(zd__world_record_parse(buf, n, "t", &back, &err), 0);
  CHECK_INT_EQ(back.world_size, 65535);
  CHECK_U64_EQ(back.step, UINT64_MAX);
}

static void refused(const char *text, const char *needle) {
  zd__world_record_t r = {.world_size = 99};
  zd__err_t err = {0};
  int rc = zd__world_record_parse(text, strlen(text), "state_dir /x/world_size", &r, &err);
  CHECK_MSG(rc == ZD_ECONFIG, "'%s' parsed (%d)", text, rc);
  CHECK_INT_EQ(r.world_size, 99); /* untouched */
  CHECK_CONTAINS(err.msg, needle);
  CHECK_CONTAINS(err.msg, "state_dir /x/world_size");
  CHECK_CONTAINS(err.msg, "world_size=N from=W step=S");
  for (const char *c = err.msg; *c; c++) /* the log shows it: printable, one line */
    CHECK_MSG(*c >= ' ' && *c <= '~', "byte 0x%02x in '%s'", (unsigned char)*c, err.msg);
}

static void test_malformed(void) {
  refused("", "empty");
  refused("\n", "empty");
  refused("world_size=abc from=4 step=1", "world_size is not a number from 1 to 65535");
  refused("world_size=0 from=4 step=1", "world_size is not a number from 1 to 65535");
  refused("world_size=65536 from=4 step=1", "world_size is not a number"); /* a resize's most */
  refused("world_size=2 from=\x01\x1b[2J step=1", "from is not a number"); /* quoted: '?' */
  refused("world_size=99999999999999999999999 from=4 step=1", "world_size is not a number");
  refused("world_size=-2 from=4 step=1", "world_size is not a number");
  refused("world_size=2 step=1", "expected 'from='");
  refused("size=2 from=4 step=1", "expected 'world_size='");
  refused("world_size=2 from=4", "expected 'step='");
  refused("world_size=2 from=4 step=x", "step is not a number from 0");
  refused("world_size=2 from=4 step=1 extra", "unexpected 'extra'");
  refused("world_size=2 from=4 step=1\nworld_size=3 from=2 step=9\n", "not one line");
  refused("world_size=2  from=4 step=1", "expected 'from='");
}

static void test_file(void) {
  char dir[] = "/tmp/zd-world-record-XXXXXX";
  CHECK(mkdtemp(dir) != NULL);
  zd__err_t err = {0};
  zd__world_record_t r = {0};
  CHECK_INT_EQ(zd__world_record_read(dir, &r, &err), -ENOENT);
  umask(022); /* a lax umask: the record is 0600 all the same */
  zd__world_record_t a = {.world_size = 2, .from = 4, .step = 8};
  CHECK_INT_EQ(zd__world_record_write(dir, "rank0", &a, &err), 0);
  CHECK_INT_EQ(zd__world_record_read(dir, &r, &err), 0);
  CHECK_INT_EQ(r.world_size, 2);
  CHECK_INT_EQ(r.from, 4);
  CHECK_U64_EQ(r.step, 8);
  char path[512];
  snprintf(path, sizeof path, "%s/world_size", dir);
  struct stat st;
  CHECK_INT_EQ(stat(path, &st), 0);
  CHECK_INT_EQ(st.st_mode & 0777, 0600);
  zd__world_record_t b = {.world_size = 3, .from = 2, .step = 12}; /* replaces it */
  CHECK_INT_EQ(zd__world_record_write(dir, "rank1", &b, &err), 0);
  CHECK_INT_EQ(zd__world_record_read(dir, &r, &err), 0);
  CHECK_INT_EQ(r.world_size, 3);
  DIR *d = opendir(dir); /* only the record: no temporary file left */
  CHECK(d != NULL);
  int files = 0;
  for (struct dirent *e; (e = readdir(d));)
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) {
      CHECK_STR_EQ(e->d_name, "world_size");
      files++;
    }
  closedir(d);
  CHECK_INT_EQ(files, 1);
  FILE *f = fopen(path, "w"); /* damaged */
  CHECK(f != NULL);
  fputs("world_size=two from=4 step=8\n", f);
  fclose(f);
  CHECK_INT_EQ(zd__world_record_read(dir, &r, &err), ZD_ECONFIG);
  CHECK_CONTAINS(err.msg, path);
  CHECK_CONTAINS(err.msg, "world_size is not a number");
  unlink(path);
  CHECK_INT_EQ(rmdir(dir), 0);
  /* a directory that is not there: the error names the file */
  zd__err_t e2 = {0};
  CHECK_INT_EQ(zd__world_record_write("/nonexistent-zd-dir", "r", &a, &e2), -ENOENT);
  CHECK_CONTAINS(e2.msg, "/nonexistent-zd-dir/.world_size.r.tmp");
}

int main(void) {
  test_parse();
  test_malformed();
  test_file();
  printf("world_record: ok\n");
  return 0;
}
