#!/usr/bin/env python3
"""Writes the seed corpora of the libFuzzer harnesses (tests/fuzz/corpus/<harness>/): a few valid
inputs per harness, so that fuzzing starts from frames, tables and config files that get past the
first checks instead of from nothing. Deterministic; run it after changing a message or an input
format and commit the result:

    tests/fuzz/make_corpus.py

Files it does not write (regression inputs from crashes, named regress-*) are left alone. The
protobuf encoding is written out here (a few lines) so that it needs no protobuf package.
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))

# ---- protobuf wire format ----


def varint(v):
    out = bytearray()
    v &= (1 << 64) - 1
    while True:
        b = v & 0x7f
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def zigzag(v):
    return (v << 1) ^ (v >> 63)


def key(field, wire):
    return varint(field << 3 | wire)


def u(field, v):  # uint32, uint64, bool, enum
    return key(field, 0) + varint(v)


def s(field, v):  # sint32
    return key(field, 0) + varint(zigzag(v))


def d(field, v):  # double
    return key(field, 1) + struct.pack('<d', v)


def ld(field, v):  # string, bytes, message
    if isinstance(v, str):
        v = v.encode()
    return key(field, 2) + varint(len(v)) + v


# ---- zerod.proto messages ----


def group(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=1e-2, optimizer=None, maximize=None):
    m = d(1, lr) + d(2, beta1) + d(3, beta2) + d(4, eps) + d(5, wd)
    if optimizer is not None:
        m += u(6, optimizer)
    if maximize is not None:
        m += u(7, maximize)
    return m


def param(name, shape, grp=0):
    return ld(1, name) + b''.join(u(2, x) for x in shape) + u(3, grp)


def scaler(initial=65536.0, growth=2.0, backoff=0.5, interval=2000, hysteresis=2, minimum=1.0):
    return (d(1, initial) + d(2, growth) + d(3, backoff) + u(4, interval) + u(5, hysteresis) +
            d(6, minimum))


MAGIC = 0x3144525a
REPLY = 0x8000
HELLO, REGISTER, STEP, SCATTER, GATHER, STATUS, BYE, ERROR = 1, 2, 3, 4, 5, 6, 7, 0x7fff


def frame(type_, body, request_id=1, version=1):
    return struct.pack('<IHHIIQ', MAGIC, version, type_, len(body), 0, request_id) + body


def frames():
    hello = u(1, 1) + u(2, 1) + s(3, 0) + ld(4, 'fuzz')
    register = (ld(1, param('fc1.weight', [32, 16])) + ld(1, param('fc1.bias', [32])) +
                ld(1, param('fc2.weight', [4, 32], 1)) + ld(2, group()) +
                ld(2, group(lr=0.01, wd=0.0, optimizer=1, maximize=1)) + u(3, 1) + u(4, 2) +
                u(5, 0x0123456789abcdef) + d(6, 1.0) + u(7, 1) + ld(8, scaler()) + u(9, 0))
    cuda = (s(1, 0) + ld(2, bytes(16)) + ld(3, bytes(64)) + ld(4, bytes(64)) +
            b''.join(ld(7, bytes(64)) for _ in range(2)) +
            b''.join(ld(8, bytes(64)) for _ in range(2)))
    register_cuda = (ld(1, param('w', [1024])) + ld(2, group()) + u(3, 1) + u(4, 3) + u(5, 7) +
                     ld(10, cuda) + u(11, 0))
    step = ld(1, group()) + ld(1, group(lr=0.5)) + u(2, 1) + u(3, 1)
    step_slot = u(2, 0) + u(3, 1) + u(4, 63)
    status_reply = ld(1, ld(1, 'node') + ld(2, ld(1, 'pid') + ld(2, '42')) +
                      ld(2, ld(1, 'uptime_s') + ld(2, '7')))
    hello_reply = (u(1, 1) + ld(2, '0.1.0') + u(3, 2) + u(4, 1) + u(5, 0) + u(6, 40000000) +
                   ld(7, 'cuda') + s(8, 0) + ld(9, bytes(range(16))))
    register_reply = (u(1, 0) + u(2, 0) + u(3, 0x0123456789abcdef) + u(4, 2048) + u(5, 1) +
                      u(6, 1024) + d(7, 65536.0))
    step_reply = u(1, 1) + u(2, 1) + d(3, 0.25) + d(4, 65536.0) + d(5, 1.0) + u(6, 1500)
    error = s(1, -22) + ld(2, 'parameter 0 has no name') + u(3, 0)
    out = {
        'hello': frame(HELLO, hello),
        'register': frame(REGISTER, register, 2),
        'register_cuda': frame(REGISTER, register_cuda, 2),
        'step': frame(STEP, step, 3),
        'step_slot': frame(STEP, step_slot, 3),
        'scatter': frame(SCATTER, s(1, -1), 4),
        'gather': frame(GATHER, s(1, 0) + u(2, 5), 5),
        'status': frame(STATUS, b'', 6),
        'bye': frame(BYE, b'', 7),
        'hello_reply': frame(HELLO | REPLY, hello_reply),
        'register_reply': frame(REGISTER | REPLY, register_reply, 2),
        'step_reply': frame(STEP | REPLY, step_reply, 3),
        'scatter_reply': frame(SCATTER | REPLY, b'', 4),
        'status_reply': frame(STATUS | REPLY, status_reply, 6),
        'bye_reply': frame(BYE | REPLY, u(1, 0), 7),
        'error': frame(ERROR, error, 9),
        'bad_magic': b'XXXX' + frame(HELLO, hello)[4:],
        'bad_version': frame(HELLO, hello, version=2),
    }
    # A whole session's worth of requests in one stream.
    out['session'] = (out['hello'] + out['register'] + out['step'] + out['scatter'] +
                      out['gather'] + out['status'] + out['bye'])
    return out


# ---- fuzz_layout.c's inputs ----


def layout_list(world, bucket_byte, ngroups, params):
    """A mode byte giving the world size (1 + mode % 8, never 0), the bucket byte, the number of
    groups, then per parameter: a byte of ndim (low 4 bits) and group (high 4 bits), the dims (a
    byte, or 0xff and 8 bytes for a large one) and the name (a length byte and the bytes)."""
    out = bytearray([world - 1 if world > 1 else 8, bucket_byte, ngroups])
    for name, shape, grp in params:
        out.append(len(shape) | grp << 4)
        for x in shape:
            if x < 0xf0:
                out.append(x)
            else:
                out += b'\xff' + struct.pack('<Q', x)
        out.append(len(name))
        out += name.encode()
    return bytes(out)


def layouts():
    mlp = [('fc1.weight', [32, 16], 0), ('fc1.bias', [32], 1), ('fc2.weight', [4, 32], 0),
           ('fc2.bias', [4], 1)]
    table = ''.join(f'{g} {len(sh)} ' + ''.join(f'{x} ' for x in sh) + f'{len(n)} {n}\n'
                    for n, sh, g in mlp)
    return {
        'mlp_w1': layout_list(1, 0, 2, mlp),
        'mlp_w4_small_buckets': layout_list(4, 1, 2, mlp),
        'scalar_and_big': layout_list(2, 0xf4, 1, [('scale', [], 0), ('emb', [50000, 1024], 0)]),
        'too_many_elems': layout_list(1, 0, 1, [('huge', [1 << 30, 1 << 30], 0)]),
        'duplicate_names': layout_list(3, 2, 1, [('w', [8], 0), ('w', [8], 0)]),
        'table_mlp': b'\0' + table.encode(),
        'table_scalar': b'\0' + b'0 0 5 scale\n',
    }


# ---- fuzz_config.c's inputs: the file, then NUL-separated arguments ----


def configs():
    full = '\n'.join([
        '# every setting once',
        'socket = /tmp/zerod-fuzz.sock',
        'socket_mode = 0600',
        'allowed_uids = 0, root',
        'allowed_gids = 0',
        'max_clients = 8',
        'max_clients_per_uid = 4',
        'hello_timeout_ms = 500',
        'max_frame_bytes = 65536',
        'frame_timeout_ms = 1000',
        'max_inflight = 4',
        'backend = cpu',
        'threads = 2',
        'kernel_isa = scalar',
        'local_ranks = 2',
        'world_size = 4',
        'first_rank = 2',
        'bucket_elems = 4096',
        'control_address = 127.0.0.1:7070',
        'rendezvous_address = "10.0.0.1:7070"',
        'collective_timeout_ms = 60000',
        'heartbeat_ms = 100',
        'peer_timeout_ms = 2000',
        'connect_timeout_ms = 60000',
        'collective_host = 127.0.0.1',
        'shutdown_timeout_ms = 0',
        'log_level = debug',
        'metrics_address = 127.0.0.1:9400',
        '',
    ])
    return {
        'full': full.encode(),
        'deploy': open(os.path.join(HERE, '..', '..', 'deploy', 'zerod.conf'), 'rb').read(),
        'flags': b'log_level warn\n\0--world-size=2\0--local_ranks\0' + b'2\0--backend\0cpu',
        'quoted_empty': b'rendezvous_address = ""\nallowed_gids=\n\0--threads=0',
        'bad_line': b'socket_mode = 999\n',
        'help': b'\0--help',
    }


# ---- fuzz_control.c's inputs: a byte picking the message, then the message ----

CONTROL = ['NodeStatusRequest', 'NodesRequest', 'KvSetRequest', 'KvGetRequest', 'KvWaitRequest',
           'KvDeleteRequest', 'HealthCheckRequest', 'NodeStatus', 'NodesReply', 'NodeInfo',
           'KvSetReply', 'KvGetReply', 'KvWaitReply', 'KvDeleteReply', 'HealthCheckResponse']


def controls():
    node_info = u(1, 0) + u(2, 2) + ld(3, '127.0.0.1:7070')
    rank = (u(1, 0) + u(2, 0) + ld(3, 'degraded') + ld(4, 'peer 1 is gone') + ld(5, 'trainer') +
            u(6, 1234) + u(7, 1) + u(8, 1024) + u(9, 12288) + u(10, 2048) + u(11, 3) +
            d(12, 65536.0) + d(13, 0.5) + u(14, 1500) + ld(15, u(1, 0) + u(2, 0) + u(3, 1024)) +
            u(16, 1) + u(17, 4))
    node_status = (ld(1, '0.1.0') + u(2, 42) + ld(3, 'unix:/tmp/c.sock') + u(4, 2) + u(5, 0) +
                   u(6, 2) + ld(7, 'cpu') + ld(8, rank) + u(9, 7) + ld(10, '127.0.0.1:7070'))
    msgs = {
        'NodeStatusRequest': b'',
        'NodesRequest': b'',
        'KvSetRequest': ld(1, 'zerod/node/0') + ld(2, node_info),
        'KvGetRequest': ld(1, 'zerod/node/0'),
        'KvWaitRequest': ld(1, 'zerod/node/0') + ld(1, 'zerod/node/1') + u(2, 1000),
        'KvDeleteRequest': ld(1, 'zerod/node/0'),
        'HealthCheckRequest': ld(1, 'zerod.v1.Control'),
        'NodeStatus': node_status,
        'NodesReply': u(1, 2) + ld(2, node_info),
        'NodeInfo': node_info,
        'KvSetReply': b'',
        'KvGetReply': u(1, 1) + ld(2, node_info),
        'KvWaitReply': u(1, 0) + ld(2, 'zerod/node/1'),
        'KvDeleteReply': u(1, 1),
        'HealthCheckResponse': u(1, 1),
    }
    return {name: bytes([CONTROL.index(name)]) + body for name, body in msgs.items()}


# ---- fuzz_session.c's inputs: operations on up to two connections to a live zerod ----

# Opcodes, and FRAME's modifier bits and descriptor kinds (see fuzz_session.c).
FRAME, RAW, PUMP, SWITCH, CLOSE, CANNED = 0, 1, 2, 3, 4, 5
ABRUPT = 8
MOD_VERSION, MOD_MAGIC, MOD_FLAGS, MOD_LENGTH, MOD_HASH = 1, 2, 4, 8, 16
FD_PARAMS, FD_GRADS, FD_SIZED, FD_PIPE, FD_UNSEALED, FD_SHORT = 0, 1, 2, 3, 4, 8
# CANNED's request byte: the type in the low 3 bits.
C_HELLO, C_REGISTER, C_STEP, C_SCATTER, C_GATHER, C_STATUS, C_BYE, C_CHECKPOINT = range(8)


def op_frame(type_, body, mod=0, fds=(), declared=None):
    out = bytes([FRAME, type_ & 0x0f | (0x10 if type_ & REPLY else 0), mod | len(fds) << 5])
    if mod & MOD_LENGTH:
        out += struct.pack('<I', declared)
    return out + bytes(fds) + struct.pack('<H', len(body)) + body


def op_raw(data):
    return bytes([RAW, len(data)]) + data


def canned(*ks):
    return b''.join(bytes([CANNED, k]) for k in ks)


def sessions():
    f = frames()
    body = {name: data[24:] for name, data in f.items()}
    hello = op_frame(HELLO, body['hello'])
    register = op_frame(REGISTER, body['register'], MOD_HASH, (FD_PARAMS, FD_GRADS))
    ready = canned(C_HELLO) + bytes([PUMP]) + canned(C_REGISTER) + bytes([PUMP])
    pump = bytes([PUMP])
    return {
        # Valid sequences: fuzzed frames with the frame corpus's bodies, then canned requests.
        'session': (hello + pump + register + pump + op_frame(STEP, body['step']) +
                    op_frame(SCATTER, body['scatter']) + op_frame(GATHER, s(1, -1)) +
                    op_frame(STATUS, b'') + op_frame(8, u(1, 1)) + pump + op_frame(BYE, b'')),
        'canned': (ready + canned(C_STEP, C_SCATTER, C_GATHER, C_STATUS, C_CHECKPOINT) + pump +
                   canned(C_BYE)),
        'canned_models': b''.join(
            canned(C_HELLO) + canned(C_REGISTER | m << 3 | 0x20, C_STEP | 0x08, C_STEP,
                                     C_CHECKPOINT | 0x08) + pump + bytes([CLOSE])
            for m in range(4)),
        'pipelined': ready + canned(*[C_STEP] * 8, C_GATHER | 1 << 3, C_STATUS) + pump,
        'two_clients': (canned(C_HELLO | 1 << 3) + pump + bytes([SWITCH]) +
                        canned(C_HELLO | 1 << 3) + pump + canned(C_REGISTER) + pump +
                        bytes([SWITCH]) + canned(C_REGISTER) + pump + bytes([SWITCH]) +
                        canned(C_HELLO) + pump + bytes([CLOSE])),
        'abrupt': ready + canned(C_STEP, C_STEP) + bytes([CLOSE | ABRUPT]) + ready,
        'split': op_raw(f['hello'][:10]) + pump + op_raw(f['hello'][10:]) + pump,
        'bye_then_more': canned(C_HELLO, C_BYE, C_STEP) + pump,
        # Error cases, one each.
        'before_hello': canned(C_STEP, C_REGISTER, C_STATUS) + pump,
        'hello_twice': canned(C_HELLO, C_HELLO) + pump,
        'bad_rank': canned(C_HELLO | 3 << 3, C_HELLO | 2 << 3) + pump,
        'bad_version': op_frame(HELLO, body['hello'], MOD_VERSION) + pump,
        'bad_flags': op_frame(HELLO, body['hello'], MOD_FLAGS) + pump,
        'bad_magic': canned(C_HELLO) + op_frame(STATUS, b'', MOD_MAGIC) + pump,
        'too_big': canned(C_HELLO) + op_frame(REGISTER, b'', MOD_LENGTH, (), 1 << 20) + pump,
        'too_big_for_status': op_frame(STATUS, bytes(100)) + pump,
        'truncated': canned(C_HELLO) + op_frame(STEP, b'\x08\x01', MOD_LENGTH, (), 100),
        'unknown_types': (op_frame(12, b'') + op_frame(HELLO | REPLY, body['hello_reply']) +
                          op_frame(ERROR, body['error']) + pump),
        'malformed': (canned(C_HELLO) + b''.join(op_frame(t, b'\xff\xff') for t in range(1, 9)) +
                      pump),
        'register_no_fds': canned(C_HELLO, C_REGISTER | 0x40) + pump,
        'register_bad_fds': canned(C_HELLO) + b''.join(
            op_frame(REGISTER, body['register'], MOD_HASH, fds) + pump
            for fds in [(FD_PARAMS | FD_SHORT, FD_GRADS), (FD_PARAMS, FD_GRADS | FD_UNSEALED),
                        (FD_PIPE, FD_GRADS), (FD_SIZED | 0x10,), (FD_PARAMS,) * 7]),
        'register_bad_hash': canned(C_HELLO) + op_frame(REGISTER, body['register'], 0,
                                                         (FD_PARAMS, FD_GRADS)) + pump,
        'register_twice': ready + canned(C_REGISTER) + pump,
        'register_cuda': (canned(C_HELLO) + op_frame(REGISTER, body['register_cuda'], MOD_HASH) +
                          pump),
        'step_before_register': canned(C_HELLO, C_STEP, C_SCATTER, C_GATHER, C_CHECKPOINT) + pump,
        'bad_bucket': ready + canned(C_SCATTER | 7 << 3, C_GATHER | 7 << 3) + pump,
        'step_groups': (ready + op_frame(STEP, body['step']) + op_frame(STEP, body['step_slot']) +
                        pump),
    }


def write(harness, files):
    folder = os.path.join(HERE, 'corpus', harness)
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        if not name.startswith('regress-'):
            os.remove(os.path.join(folder, name))
    for name, data in files.items():
        with open(os.path.join(folder, name), 'wb') as f:
            f.write(data)


if __name__ == '__main__':
    write('frame', frames())
    write('layout', layouts())
    write('config', configs())
    write('control', controls())
    write('session', sessions())
