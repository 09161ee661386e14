/* The Gloo shim (gloo.h): one TCP Gloo context per rank, the rendezvous through zerod's key-value
 * store, and the three collectives the CPU backend needs, behind an extern "C" API.
 *
 * It exists because Gloo is C++ and throws: every entry point catches all exceptions and turns
 * them into an error code with a message that names the operation, the peer rank and the cause.
 * The collectives are written here on Gloo's unbound buffers instead of Gloo's own algorithms:
 * Gloo's only reduce-scatter (ReduceScatterHalvingDoubling) deadlocks a following allgather
 * (../shared/STACK.md), and our own rings let us fix the order of additions, sum bf16/f16
 * gradients in fp32 without a converted copy of the whole bucket, and know which peer a failed
 * wait was talking to.
 */

/* zerod's C headers without C++ guards: give their functions C linkage before gloo.h includes
 * them (their include guards keep the second inclusion empty). */
extern "C" {
#include "adam.h"
#include "error.h"
}
#include "gloo.h"

#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;
using Buffer = gloo::transport::UnboundBuffer;

/* Reduce-scatter moves fp32 partial sums in messages of at most this many elements (4 MiB), so
 * its scratch memory is bounded (kLanes * 2 pieces, 16 MiB) whatever the bucket size. On loopback
 * here 4 MiB pieces beat 1 and 2 MiB (fewer round trips of Gloo's send/recv handshake) and the
 * whole chunk in one message (no overlap of additions with transfers). */
constexpr uint64_t kPiece = (uint64_t)1 << 20;
/* Pieces in flight at once: while one lane adds a received piece, the other's transfer runs on
 * Gloo's I/O thread. One lane halved the reduce-scatter's bandwidth on loopback. */
constexpr int kLanes = 2;

/* A slot (Gloo's message tag) holds the operation (4 bits), the caller's tag (16 bits: the bucket),
 * a per-context call counter (20 bits) and the message within the call (24 bits). Ranks whose
 * sequences of calls differ, or that name different buckets at the same point, then wait on
 * different slots and fail by timeout instead of reading each other's data. */
enum Kind : uint64_t { kReduceScatter = 1, kAllGather = 2, kAllGatherBytes = 3 };

/* zd__gloo_abort interrupted a wait. */
struct Aborted : std::runtime_error {
  Aborted() : std::runtime_error("aborted") {}
};

/* An error whose code and message are already known (store failures, bad arguments). */
struct Failure : std::runtime_error {
  int code;
  Failure(int c, const std::string &msg) : std::runtime_error(msg), code(c) {}
};

/* A Gloo exception raised while posting or waiting for a transfer with one peer. */
struct PeerError : std::runtime_error {
  int peer;
  const char *dir; /* "receiving from", "sending to" */
  PeerError(int p, const char *d, const char *what) : std::runtime_error(what), peer(p), dir(d) {}
};

std::string format(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char *fmt, ...) {
  char buf[ZD__ERR_MSG_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

/* Gloo's messages start with "[file:line] " and may end with advice ("This is typically caused
 * by ... GLHF!"): keep the sentence in between. */
std::string gloo_cause(const char *what) {
  std::string s(what);
  if (!s.empty() && s[0] == '[') {
    size_t end = s.find("] ");
    if (end != std::string::npos) s.erase(0, end + 2);
  }
  size_t stop = s.find(". ");
  if (stop != std::string::npos) s.erase(stop);
  return s;
}

bool contains(const std::string &s, const char *needle) {
  return s.find(needle) != s.npos;
}

/* gloo::rendezvous::Store over zerod's key-value callbacks. Every key is prefixed with the
 * world's prefix, and every wait is cut at the connect deadline, so a rank that never joins
 * fails the connect within connect_timeout_ms however many keys Gloo waits for. */
class KvStore : public gloo::rendezvous::Store {
 public:
  KvStore(const zd__kv_t *kv, const char *prefix, Clock::time_point deadline, int timeout_ms)
      : kv_(kv), prefix_(prefix), deadline_(deadline), timeout_ms_(timeout_ms) {}

  void set(const std::string &key, const std::vector<char> &data) override {
    zd__err_t err = {};
    std::string k = join(key);
    /* Gloo sets some keys to empty values: never hand the callback a null pointer. */
    const char *value = data.empty() ? "" : data.data();
    int rc = kv_->set(kv_->ctx, k.c_str(), value, data.size(), &err);
    if (rc) throw Failure(rc, format("connect: store set '%s' failed: %s", k.c_str(), err.msg));
  }

  std::vector<char> get(const std::string &key) override {
    zd__err_t err = {};
    std::string k = join(key);
    void *value = nullptr;
    size_t len = 0;
    int rc = kv_->get(kv_->ctx, k.c_str(), &value, &len, remaining_ms(), &err);
    if (rc) throw failure(rc, k, err);
    std::vector<char> out((char *)value, (char *)value + len);
    free(value);
    return out;
  }

  void wait(const std::vector<std::string> &keys) override { wait(keys, milliseconds(-1)); }

  void wait(const std::vector<std::string> &keys, const milliseconds &timeout) override {
    std::vector<std::string> full;
    std::vector<const char *> ptrs;
    for (const auto &key : keys) full.push_back(join(key));
    for (const auto &k : full) ptrs.push_back(k.c_str());
    /* Gloo passes its context's timeout, which bounds the TCP connections (pair_timeout_ms):
     * a peer's address is waited for until the store's deadline. */
    (void)timeout;
    int ms = remaining_ms();
    zd__err_t err = {};
    int rc = kv_->wait(kv_->ctx, ptrs.data(), ptrs.size(), ms, &err);
    if (rc) throw failure(rc, full.empty() ? std::string() : full[0], err);
  }

 private:
  /* "<prefix>/<key>"; a prefix that already ends with '/' gets no second one. */
  std::string join(const std::string &key) const {
    if (prefix_.empty() || prefix_.back() == '/') return prefix_ + key;
    return prefix_ + "/" + key;
  }

  int remaining_ms() const {
    auto left = std::chrono::duration_cast<milliseconds>(deadline_ - Clock::now()).count();
    return left > 0 ? (int)left : 0;
  }

  /* Gloo's connect publishes each rank's addresses under the key "<rank>" (and its host name
   * under "rank_<rank>"): a key that never appears is a rank that never joined. */
  Failure failure(int rc, const std::string &k, const zd__err_t &err) const {
    if (rc != -ETIMEDOUT)
      return Failure(rc, format("connect: store lookup of '%s' failed: %s", k.c_str(), err.msg));
    std::string key = k.substr(k.rfind('/') + 1);
    if (key.compare(0, 5, "rank_") == 0) key.erase(0, 5);
    bool is_rank = !key.empty() && key.find_first_not_of("0123456789") == std::string::npos;
    return Failure(-ETIMEDOUT,
                   format("connect: %s%s did not join within %d ms (no key '%s' in "
                          "the rendezvous store)",
                          is_rank ? "rank " : "key ", key.c_str(), timeout_ms_, k.c_str()));
  }

  const zd__kv_t *kv_;
  std::string prefix_;
  Clock::time_point deadline_;
  int timeout_ms_;
};

}  // namespace

struct zd__gloo {
  std::shared_ptr<gloo::transport::Device> dev;
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  int rank = 0;
  int size = 1;
  int timeout_ms = 0;
  milliseconds timeout{0};
  uint32_t calls = 0;
  int broken = 0; /* the code of the failure that made the context unusable; 0: healthy */
  std::string why;
  /* zd__gloo_abort (another thread) interrupts the buffers being waited for, by Gloo's own
   * abortWaitRecv/abortWaitSend; the flag refuses the waits that had not started yet. */
  std::mutex abort_mu;
  bool aborted = false;
  int abort_code = -ECANCELED; /* the first abort's, under abort_mu */
  std::string abort_why;
  std::vector<gloo::transport::UnboundBuffer *> waiting;
  std::unique_ptr<float[]> scratch; /* reduce-scatter: kLanes lanes of 2 pieces, on first use */
};

namespace {

uint64_t next_slot(zd__gloo *g, Kind kind, uint32_t tag) {
  return (uint64_t)kind << 60 | (uint64_t)(tag & 0xffff) << 44 |
         (uint64_t)(g->calls++ & 0xfffff) << 24;
}

uint64_t message_slot(uint64_t base, uint64_t index) {
  return base | (index & 0xffffff);
}

int ring_mod(int x, int w) {
  return ((x % w) + w) % w;
}

/* Posting and waiting, with the peer recorded when Gloo throws. Each wait is bounded by the
 * collective timeout: a transfer that makes no progress for that long fails the collective. */
void post_recv(Buffer &b, int peer, uint64_t slot) {
  try {
    b.recv(peer, slot);
  } catch (const std::exception &e) {
    throw PeerError(peer, "receiving from", e.what());
  }
}

void post_send(Buffer &b, int peer, uint64_t slot) {
  try {
    b.send(peer, slot);
  } catch (const std::exception &e) {
    throw PeerError(peer, "sending to", e.what());
  }
}

/* Makes a wait on b abortable for its duration (an abort may come before the wait starts: the
 * buffer keeps it until then). */
class AbortableWait {
 public:
  AbortableWait(zd__gloo *g, Buffer &b) : g_(g), b_(&b) {
    std::lock_guard<std::mutex> lock(g->abort_mu);
    if (g->aborted) throw Aborted();
    g->waiting.push_back(b_);
  }
  ~AbortableWait() {
    std::lock_guard<std::mutex> lock(g_->abort_mu);
    g_->waiting.erase(std::find(g_->waiting.begin(), g_->waiting.end(), b_));
  }

 private:
  zd__gloo *g_;
  Buffer *b_;
};

void wait_recv(zd__gloo *g, Buffer &b, int peer) {
  AbortableWait guard(g, b);
  bool done;
  try {
    done = b.waitRecv(nullptr, g->timeout);
  } catch (const std::exception &e) {
    throw PeerError(peer, "receiving from", e.what());
  }
  if (!done) throw Aborted();
}

void wait_send(zd__gloo *g, Buffer &b, int peer) {
  AbortableWait guard(g, b);
  bool done;
  try {
    done = b.waitSend(nullptr, g->timeout);
  } catch (const std::exception &e) {
    throw PeerError(peer, "sending to", e.what());
  }
  if (!done) throw Aborted();
}

std::unique_ptr<Buffer> buffer(zd__gloo *g, const void *ptr, size_t bytes) {
  /* Gloo's buffers are read-write; the ones we only send from are never written. */
  return g->ctx->createUnboundBuffer(const_cast<void *>(ptr), bytes);
}

void to_f32(float *dst, const void *src, zd_dtype_t dtype, uint64_t n) {
  if (dtype == ZD_F32) {
    memcpy(dst, src, n * sizeof(float));
  } else if (dtype == ZD_BF16) {
    const uint16_t *s = (const uint16_t *)src;
    for (uint64_t i = 0; i < n; i++) dst[i] = zd__bf16_to_f32(s[i]);
  } else {
    const uint16_t *s = (const uint16_t *)src;
    for (uint64_t i = 0; i < n; i++) dst[i] = zd__f16_to_f32(s[i]);
  }
}

/* acc[i] = acc[i] + own[i]: the partial sum so far first, this rank's value second. */
void add_own(float *acc, const void *own, zd_dtype_t dtype, uint64_t n) {
  if (dtype == ZD_F32) {
    const float *s = (const float *)own;
    for (uint64_t i = 0; i < n; i++) acc[i] = acc[i] + s[i];
  } else if (dtype == ZD_BF16) {
    const uint16_t *s = (const uint16_t *)own;
    for (uint64_t i = 0; i < n; i++) acc[i] = acc[i] + zd__bf16_to_f32(s[i]);
  } else {
    const uint16_t *s = (const uint16_t *)own;
    for (uint64_t i = 0; i < n; i++) acc[i] = acc[i] + zd__f16_to_f32(s[i]);
  }
}

/* Ring reduce-scatter (the order is documented in gloo.h). Chunk c's sum starts at rank c + 1 and
 * travels right around the ring, each rank adding its own values, and ends at rank c. In ring
 * step s (0 <= s < W - 1) rank r sends chunk r - s - 1 to its right and receives chunk r - s - 2
 * from its left, adds its own values of that chunk and sends the result on in step s + 1; the
 * last step receives straight into recv. Each chunk is cut into pieces of kPiece elements that go
 * through the W - 1 steps independently, kLanes of them in flight. */
void reduce_scatter(zd__gloo *g, const void *send, zd_dtype_t dtype, float *recv, uint64_t count,
                    uint32_t tag) {
  const int w = g->size, r = g->rank, left = ring_mod(r - 1, w), right = ring_mod(r + 1, w);
  const size_t esize = zd_dtype_size(dtype);
  const uint64_t base = next_slot(g, kReduceScatter, tag);
  auto own = [&](int chunk, uint64_t off) {
    return (const char *)send + ((uint64_t)chunk * count + off) * esize;
  };
  if (w == 1 || count == 0) {
    to_f32(recv, own(0, 0), dtype, count);
    return;
  }
  const uint64_t npieces = (count + kPiece - 1) / kPiece;
  /* Scratch: a converted first piece (bf16/f16) and partial sums in transit (W > 2). Left
   * uninitialised: only the pages that small calls touch are ever committed. */
  if ((dtype != ZD_F32 || w > 2) && !g->scratch) g->scratch.reset(new float[2 * kLanes * kPiece]);

  struct Lane {
    bool busy = false;
    uint64_t piece = 0, off = 0, n = 0;
    int step = 0;
    float *out = nullptr, *in = nullptr, *dst = nullptr;
    std::unique_ptr<Buffer> rbuf, sbuf;
  } lanes[kLanes];
  uint64_t next_piece = 0;

  auto post = [&](Lane &l) {
    const uint64_t slot = message_slot(base, l.piece * (uint64_t)(w - 1) + (uint64_t)l.step);
    l.dst = l.step == w - 2 ? recv + l.off : l.in;
    l.rbuf = buffer(g, l.dst, l.n * sizeof(float));
    post_recv(*l.rbuf, left, slot);
    const void *src = l.out;
    if (l.step == 0) {
      const void *mine = own(ring_mod(r - 1, w), l.off);
      if (dtype == ZD_F32)
        src = mine;
      else
        to_f32(l.out, mine, dtype, l.n);
    }
    l.sbuf = buffer(g, src, l.n * sizeof(float));
    post_send(*l.sbuf, right, slot);
  };
  auto start = [&](Lane &l) {
    l.busy = next_piece < npieces;
    if (!l.busy) return;
    l.piece = next_piece++;
    l.off = l.piece * kPiece;
    l.n = std::min(kPiece, count - l.off);
    l.step = 0;
    post(l);
  };

  for (int i = 0; i < kLanes; i++) {
    if (g->scratch) {
      lanes[i].out = g->scratch.get() + (2 * i) * kPiece;
      lanes[i].in = g->scratch.get() + (2 * i + 1) * kPiece;
    }
    start(lanes[i]);
  }
  for (bool any = true; any;) {
    any = false;
    for (Lane &l : lanes) {
      if (!l.busy) continue;
      any = true;
      wait_recv(g, *l.rbuf, left);
      add_own(l.dst, own(ring_mod(r - l.step - 2, w), l.off), dtype, l.n);
      wait_send(g, *l.sbuf, right);
      std::swap(l.in, l.out); /* what we received and added is what we send next */
      if (++l.step < w - 1)
        post(l);
      else
        start(l);
    }
  }
}

/* Ring all-gather in place: in step s rank r sends slice r - s to its right and receives slice
 * r - s - 1 from its left, straight into buf. */
void all_gather(zd__gloo *g, void *buf, size_t bytes, uint32_t tag) {
  const int w = g->size, r = g->rank, left = ring_mod(r - 1, w), right = ring_mod(r + 1, w);
  const uint64_t base = next_slot(g, kAllGather, tag);
  if (w == 1 || bytes == 0) return;
  char *p = (char *)buf;
  for (int s = 0; s < w - 1; s++) {
    auto rb = buffer(g, p + (size_t)ring_mod(r - s - 1, w) * bytes, bytes);
    auto sb = buffer(g, p + (size_t)ring_mod(r - s, w) * bytes, bytes);
    post_recv(*rb, left, message_slot(base, (uint64_t)s));
    post_send(*sb, right, message_slot(base, (uint64_t)s));
    wait_recv(g, *rb, left);
    wait_send(g, *sb, right);
  }
}

/* Small records: every rank sends its record to every other rank directly (one round trip
 * instead of W - 1 ring steps). One buffer per peer and direction, so a failure names the peer. */
void allgather_bytes(zd__gloo *g, const void *send, size_t bytes, void *recv) {
  const int w = g->size, r = g->rank;
  const uint64_t slot = message_slot(next_slot(g, kAllGatherBytes, 0), 0);
  char *out = (char *)recv;
  if (bytes) memmove(out + (size_t)r * bytes, send, bytes);
  if (w == 1 || bytes == 0) return;
  std::vector<std::unique_ptr<Buffer>> rbufs(w), sbufs(w);
  for (int q = 0; q < w; q++) {
    if (q == r) continue;
    rbufs[q] = buffer(g, out + (size_t)q * bytes, bytes);
    post_recv(*rbufs[q], q, slot);
  }
  for (int q = 0; q < w; q++) {
    if (q == r) continue;
    sbufs[q] = buffer(g, out + (size_t)r * bytes, bytes);
    post_send(*sbufs[q], q, slot);
  }
  for (int q = 0; q < w; q++)
    if (q != r) wait_recv(g, *rbufs[q], q);
  for (int q = 0; q < w; q++)
    if (q != r) wait_send(g, *sbufs[q], q);
}

/* A failed collective leaves the context unusable: Gloo's pairs may hold half-sent messages and
 * the ranks no longer agree on which call is next. Closing every connection makes the other ranks
 * fail at once ("closed by peer") instead of waiting out their own timeouts. */
int fail(zd__gloo *g, int code, std::string msg, zd__err_t *err) {
  g->broken = code;
  g->why = std::move(msg);
  try {
    if (g->ctx) g->ctx->closeConnections();
  } catch (const std::exception &) {
    /* already closed; nothing else to release */
  }
  return zd__errf(err, code, "%s", g->why.c_str());
}

/* Runs one collective: refuses it on a broken context, turns any exception into a code and a
 * message naming op, the peer and the cause, and breaks the context when it fails. */
template <typename Body>
int run(zd__gloo *g, const char *op, zd__err_t *err, Body body) {
  if (!g) return zd__errf(err, ZD_EINTERNAL, "%s: no Gloo context", op);
  if (g->broken)
    return zd__errf(err, g->broken, "%s: Gloo context failed earlier: %s", op, g->why.c_str());
  try {
    body();
    return ZD_OK;
  } catch (const PeerError &e) {
    std::string cause = gloo_cause(e.what());
    if (contains(cause, "Timed out") || contains(cause, "timeout"))
      return fail(g, -ETIMEDOUT,
                  format("%s: timed out after %d ms %s rank %d (peer silent or stalled)", op,
                         g->timeout_ms, e.dir, e.peer),
                  err);
    /* A peer that exits closes its sockets (EOF); one that fails a collective closes them hard
     * (reset) so that its neighbours stop at once too. */
    if (contains(cause, "closed by peer") || contains(cause, "Socket closed") ||
        contains(cause, "reset by peer"))
      return fail(g, ZD_EPEER,
                  format("%s: connection to rank %d %s by peer (%s)", op, e.peer,
                         contains(cause, "reset by peer") ? "reset" : "closed", cause.c_str()),
                  err);
    return fail(g, ZD_EPEER, format("%s: %s rank %d failed: %s", op, e.dir, e.peer, cause.c_str()),
                err);
  } catch (const Aborted &) {
    int code;
    std::string why;
    {
      std::lock_guard<std::mutex> lock(g->abort_mu);
      code = g->abort_code;
      why = g->abort_why;
    }
    return fail(g, code, format("%s: aborted (%s)", op, why.c_str()), err);
  } catch (const Failure &e) {
    return fail(g, e.code, format("%s: %s", op, e.what()), err);
  } catch (const std::bad_alloc &) {
    return fail(g, -ENOMEM, format("%s: out of memory", op), err);
  } catch (const gloo::IoException &e) {
    return fail(g, ZD_EPEER, format("%s: %s", op, gloo_cause(e.what()).c_str()), err);
  } catch (const std::exception &e) {
    return fail(g, ZD_EINTERNAL, format("%s: %s", op, gloo_cause(e.what()).c_str()), err);
  } catch (...) {
    return fail(g, ZD_EINTERNAL, format("%s: unknown C++ exception", op), err);
  }
}

}  // namespace

extern "C" int zd__gloo_connect(const zd__gloo_opts_t *opts, zd__gloo_t **out, zd__err_t *err) {
  *out = nullptr;
  if (!opts->kv || !opts->kv->set || !opts->kv->get || !opts->kv->wait || !opts->prefix ||
      !opts->host)
    return zd__errf(err, ZD_EINTERNAL, "connect: key-value store, prefix and host are required");
  if (opts->world_size == 0 || opts->rank >= opts->world_size || opts->world_size > 1u << 20)
    return zd__errf(err, ZD_ECONFIG, "connect: rank %u is not in a world of %u ranks", opts->rank,
                    opts->world_size);
  if (opts->timeout_ms <= 0 || opts->connect_timeout_ms <= 0)
    return zd__errf(err, ZD_ECONFIG, "connect: timeouts must be > 0 ms (collective %d, connect %d)",
                    opts->timeout_ms, opts->connect_timeout_ms);

  /* Gloo writes sockets with writev(), which raises SIGPIPE when a peer has died: that must be
   * an error code, not the end of the process. Only a default disposition is changed. */
  struct sigaction sa;
  if (sigaction(SIGPIPE, nullptr, &sa) == 0 && sa.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);

  zd__gloo *g = nullptr;
  const char *stage = "creating the TCP device";
  try {
    g = new zd__gloo;
    g->rank = (int)opts->rank;
    g->size = (int)opts->world_size;
    g->timeout_ms = opts->timeout_ms;
    g->timeout = milliseconds(opts->timeout_ms);

    gloo::transport::tcp::attr attr;
    attr.hostname = opts->host;
    g->dev = gloo::transport::tcp::CreateDevice(attr);

    /* During the connect, the context timeout bounds each TCP connection (pair_timeout_ms); the
     * store waits share one deadline. Afterwards every collective passes its own timeout to each
     * wait. */
    stage = "connecting to the other ranks";
    g->ctx = std::make_shared<gloo::rendezvous::Context>(g->rank, g->size);
    int pair_ms = opts->pair_timeout_ms > 0 && opts->pair_timeout_ms < opts->connect_timeout_ms
                      ? opts->pair_timeout_ms
                      : opts->connect_timeout_ms;
    g->ctx->setTimeout(milliseconds(pair_ms));
    KvStore store(opts->kv, opts->prefix, Clock::now() + milliseconds(opts->connect_timeout_ms),
                  opts->connect_timeout_ms);
    g->ctx->connectFullMesh(store, g->dev);
    g->ctx->setTimeout(g->timeout);
    *out = g;
    return ZD_OK;
  } catch (const Failure &e) {
    delete g;
    return zd__errf(err, e.code, "%s", e.what());
  } catch (const std::bad_alloc &) {
    delete g;
    return zd__errf(err, -ENOMEM, "connect: out of memory");
  } catch (const std::exception &e) {
    delete g;
    std::string cause = gloo_cause(e.what());
    int code = contains(cause, "imeout") || contains(cause, "Timed out") ? -ETIMEDOUT : ZD_EPEER;
    if (!strcmp(stage, "creating the TCP device")) code = ZD_ECONFIG;
    return zd__errf(err, code, "connect: rank %d of %d, %s on host '%s': %s", (int)opts->rank,
                    (int)opts->world_size, stage, opts->host, cause.c_str());
  } catch (...) {
    delete g;
    return zd__errf(err, ZD_EINTERNAL, "connect: unknown C++ exception while %s", stage);
  }
}

extern "C" void zd__gloo_destroy(zd__gloo_t *g) {
  if (!g) return;
  try {
    g->ctx.reset(); /* closes the pairs */
    g->dev.reset(); /* stops the I/O thread */
  } catch (...) {
    /* destructors of a broken context; nothing left to release */
  }
  delete g;
}

extern "C" int zd__gloo_failed(const zd__gloo_t *g) {
  return g->broken != 0;
}

extern "C" void zd__gloo_abort(zd__gloo_t *g, int code, const char *why) {
  std::lock_guard<std::mutex> lock(g->abort_mu);
  if (!g->aborted) {
    g->abort_code = code;
    g->abort_why = why ? why : "aborted";
  }
  g->aborted = true;
  for (gloo::transport::UnboundBuffer *b : g->waiting) {
    b->abortWaitRecv();
    b->abortWaitSend();
  }
}

extern "C" int zd__gloo_reduce_scatter(zd__gloo_t *g, const void *send, zd_dtype_t dtype,
                                       float *recv, uint64_t count, uint32_t tag, zd__err_t *err) {
  if (!zd__dtype_ok(dtype, ZD__DTYPE_GRAD))
    return zd__errf(err, ZD_EDTYPE, "reduce-scatter: dtype %d is not f32, bf16 or f16", (int)dtype);
  return run(g, "reduce-scatter", err, [&] { reduce_scatter(g, send, dtype, recv, count, tag); });
}

extern "C" int zd__gloo_all_gather(zd__gloo_t *g, void *buf, size_t bytes, uint32_t tag,
                                   zd__err_t *err) {
  return run(g, "all-gather", err, [&] { all_gather(g, buf, bytes, tag); });
}

extern "C" int zd__gloo_allgather_bytes(zd__gloo_t *g, const void *send, size_t bytes, void *recv,
                                        zd__err_t *err) {
  return run(g, "allgather-bytes", err, [&] { allgather_bytes(g, send, bytes, recv); });
}
