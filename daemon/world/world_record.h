/* The world size record: the size a live resize gave the world, kept where a zerod that starts
 * again finds it (docs/design.md, "Live resize").
 *
 * A live resize (resize.h) changes the world's size in memory only; a zerod that restarts reads
 * its configured world_size again, and after a shrink that size is wrong: a rank that stays would
 * wait for ranks that are gone, a rank that was removed would join as if nothing happened. So when
 * a resize commits every zerod writes the record into its state_dir (file ZD__WORLD_RECORD_FILE),
 * and rank 0 into the rendezvous store (key ZD__WORLD_RECORD_KEY, the built-in store or etcd); at
 * start the record found replaces the configured size (setting world_size_record = use): the
 * store's where it holds one (rank 0 writes every resize's there, and once more after it started
 * again: it is the newest), else the state_dir's (the store unreachable, or a built-in store that
 * restarted with rank 0 before rank 0 joined).
 *
 * The record is one line of text: "world_size=N from=W step=S\n": the new size, the size before,
 * and the step the resize rode (for the messages: steps may go back, a world resumed from an
 * older checkpoint, so they do not order records).
 *
 * Thread safety: none needed (no shared state). Every function may block on the disk or the store.
 */
#ifndef ZD_WORLD_WORLD_RECORD_H
#define ZD_WORLD_WORLD_RECORD_H

#include <stddef.h>
#include <stdint.h>

#include "error.h"

#define ZD__WORLD_RECORD_FILE "world_size"
#define ZD__WORLD_RECORD_KEY  "zerod/world_size"
#define ZD__WORLD_RECORD_MAX  128 /* bytes of a record, newline included, and more than any */

typedef struct zd__world_record {
  uint32_t world_size; /* the world's size since the resize (1..65536) */
  uint32_t from;       /* its size before */
  uint64_t step;       /* the step the resize rode */
} zd__world_record_t;

/* Parses text (len bytes, not NUL-terminated; one trailing newline allowed). `where` names the
 * source for the message ("state_dir /x/world_size"). Errors: ZD_ECONFIG naming what is wrong and
 * the form expected. */
int zd__world_record_parse(const char *text, size_t len, const char *where, zd__world_record_t *out,
                           zd__err_t *err);

/* The record as text into buf (at least ZD__WORLD_RECORD_MAX bytes). Returns its length. */
size_t zd__world_record_format(const zd__world_record_t *rec, char *buf, size_t len);

/* Writes the record into dir/ZD__WORLD_RECORD_FILE atomically (a temporary file named for `tag`,
 * written, synced, mode 0600, renamed over the record): a reader sees the old record or the new
 * one. Errors: -errno naming the file. */
int zd__world_record_write(const char *dir, const char *tag, const zd__world_record_t *rec,
                           zd__err_t *err);

/* Reads dir/ZD__WORLD_RECORD_FILE. -ENOENT (no message) when there is none; a malformed record:
 * ZD_ECONFIG (zd__world_record_parse); else -errno naming the file. */
int zd__world_record_read(const char *dir, zd__world_record_t *out, zd__err_t *err);

/* Rank 0: stores the record in the rendezvous store at `address` (replacing an older one), with
 * the control token where there is one. Errors: the store's (rendezvous.h). */
int zd__world_record_publish(const char *address, const char *token, const zd__world_record_t *rec,
                             int timeout_ms, zd__err_t *err);

/* Reads the record from the store at `address`: -ENOENT (no message) when the store holds none;
 * ZD_ECONFIG with *malformed set when the record is malformed; else the store's errors (it could
 * not be reached in timeout_ms, rendezvous.h). */
int zd__world_record_lookup(const char *address, const char *token, zd__world_record_t *out,
                            int *malformed, int timeout_ms, zd__err_t *err);

#endif /* ZD_WORLD_WORLD_RECORD_H */
