"""A captured CUDA graph rebound to tensors at other addresses, through the driver's exec-graph updates.

An op's call captured once holds the addresses of the tensors it was called with: in kernel parameters (pointers,
and the base address in the first word of a TMA descriptor), in the copies' sources and destinations and in the
memsets' destinations. ``GraphPatch`` finds every 8-byte word of those that falls in a given set of byte ranges
(the call's tensors) and rewrites them in the instantiated graph (cuGraphExecKernelNodeSetParams,
cuGraphExecMemcpyNodeSetParams, cuGraphExecMemsetNodeSetParams) for the same call on tensors elsewhere. Updates
apply to later launches only; launches already enqueued keep the values they were launched with.

Whether rewriting the words is all that differs between two calls is not something this module assumes: a host
computation can derive other values from an address (a gap between two tensors, a table of pointers in device
memory). ``fingerprint`` describes the whole graph (nodes, their parameters with the ranges' words rewritten to
given addresses, and edges), so that a caller can compare a graph rebound to a second call's addresses with a
capture of that second call and rebind only when the two are the same (ops.replay does). Graphs with nodes this
module cannot read or rewrite (host nodes, child graphs, allocations, copies from host memory, flag writes and
waits on the tensors' own memory, kernels whose parameters cannot be listed or were passed in ``extra``) get no
patch.
"""
from __future__ import annotations

import ctypes

from .cuda import check, driver

WORD = 8


class GraphPatch:
    """Where the words of ``ranges`` ([lo, hi) byte ranges, one per tensor) sit in a captured graph, and how to
    rewrite them in its instantiated graph. Build with ``GraphPatch.of``."""

    def __init__(self, graph, exec_ptr: int, nodes: list, edges: tuple, ranges: list):
        self._graph = graph  # the torch.cuda.CUDAGraph (kept alive: it owns the nodes and the exec)
        self._exec = driver().CUgraphExec(exec_ptr)
        self._ctx = check(driver().cuCtxGetCurrent(), "cuCtxGetCurrent")
        self._nodes = nodes  # [(type name, node, data)]
        self._edges = edges
        self.bases = tuple(lo for lo, _ in ranges)

    @classmethod
    def read(cls, graph, ranges) -> "GraphPatch | str":
        """The patch of ``graph`` (a torch.cuda.CUDAGraph captured with keep_graph=True, instantiated) for the
        tensors at ``ranges``, or why there is none: a node that cannot be read or rewritten, or a driver call
        that failed while reading the graph (the graph then replays only for the addresses it was captured
        with)."""
        try:
            return cls._read(graph, ranges)
        except (RuntimeError, TypeError, ValueError, AttributeError) as e:
            return f"reading the graph failed: {e}"

    @classmethod
    def _read(cls, graph, ranges):
        drv = driver()
        g = drv.CUgraph(graph.raw_cuda_graph())
        _, count = check(drv.cuGraphGetNodes(g, 0), "cuGraphGetNodes")
        handles, _ = check(drv.cuGraphGetNodes(g, count), "cuGraphGetNodes") if count else ([], 0)
        T = drv.CUgraphNodeType
        nodes = []
        for node in handles:
            kind = check(drv.cuGraphNodeGetType(node), "cuGraphNodeGetType")
            if kind == T.CU_GRAPH_NODE_TYPE_KERNEL:
                k = _KernelNode(node, ranges)
                if k.unreadable:
                    return k.unreadable
                nodes.append(("kernel", node, k))
            elif kind == T.CU_GRAPH_NODE_TYPE_MEMCPY:
                m = _MemcpyNode(node, ranges)
                if m.from_host:
                    return "a copy from host memory"  # its bytes are read at launch: an address could hide in them
                nodes.append(("memcpy", node, m))
            elif kind == T.CU_GRAPH_NODE_TYPE_MEMSET:
                nodes.append(("memset", node, _MemsetNode(node, ranges)))
            elif kind == T.CU_GRAPH_NODE_TYPE_BATCH_MEM_OP:
                b = _BatchMemOpNode(node)
                if b.unknown:
                    return "a stream memory operation other than a 32-bit write or wait"
                if any(lo <= a < hi for a in b.addresses for lo, hi in ranges):
                    return "a flag write or wait on a tensor of the call"  # not rewritten here
                nodes.append(("batch", node, b))
            elif kind in (T.CU_GRAPH_NODE_TYPE_EMPTY, T.CU_GRAPH_NODE_TYPE_EVENT_RECORD,
                          T.CU_GRAPH_NODE_TYPE_WAIT_EVENT):
                nodes.append((str(kind), node, None))
            else:
                return f"a node of type {kind}"
        index = {int(n): i for i, (_, n, _) in enumerate(nodes)}
        n_edges = check(drv.cuGraphGetEdges(g, 0), "cuGraphGetEdges")[-1] if count else 0
        edges = ()
        if n_edges:  # (from, to[, edge data], count): the edge data's place differs between CUDA 12 and 13
            src, dst = check(drv.cuGraphGetEdges(g, n_edges), "cuGraphGetEdges")[:2]
            edges = tuple(sorted((index[int(a)], index[int(b)]) for a, b in zip(src, dst)))
        return cls(graph, graph.raw_cuda_graph_exec(), nodes, edges, ranges)

    @property
    def sites(self) -> int:
        """How many nodes hold an address of the ranges (each is updated when the addresses change)."""
        return sum(1 for _, _, d in self._nodes if d is not None and getattr(d, "words", None))

    def fingerprint(self, bases) -> tuple:
        """Every node's type and parameters, with the ranges' words as they would be at ``bases`` (one address per
        range), and the edges: equal for two graphs exactly when this one rebound to ``bases`` is the other."""
        return (tuple((kind, d.describe(bases) if d is not None else None) for kind, _, d in self._nodes),
                self._edges)

    def apply(self, bases) -> None:
        """Rewrite the ranges' words to ``bases`` in the instantiated graph (for its next launches)."""
        if tuple(bases) == self.bases:
            return
        for _, node, d in self._nodes:
            if d is not None and getattr(d, "words", None):
                d.set(self._exec, node, bases, self._ctx)
        self.bases = tuple(bases)


def _moved(value: int, ranges):
    """(range index, offset) of ``value`` in the first of ``ranges`` holding it, else None."""
    for i, (lo, hi) in enumerate(ranges):
        if lo <= value < hi:
            return i, value - lo
    return None


class _KernelNode:
    """A kernel node's parameters (sizes from cuFuncGetParamInfo) and the words in them that hold a range's
    address."""

    def __init__(self, node, ranges):
        drv = driver()
        p = check(drv.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
        sizes, i = [], 0
        self.unreadable = None  # why its parameters could not be read
        past_end = int(drv.CUresult.CUDA_ERROR_INVALID_VALUE)
        while True:
            err, _, size = drv.cuFuncGetParamInfo(p.func, i)
            if int(err) == past_end:
                break
            if int(err) != 0:
                self.unreadable = f"a kernel's parameter {i} could not be read: {err!r}"
                return
            sizes.append(size)
            i += 1
        if not sizes and _num(p.kernelParams) != 0:
            self.unreadable = "a kernel whose parameters could not be listed"
            return
        if _num(p.extra) != 0:
            self.unreadable = "a kernel launched with its parameters in 'extra'"
            return
        ptrs = (ctypes.c_void_p * len(sizes)).from_address(int(p.kernelParams)) if sizes else []
        self.values = [ctypes.string_at(ptrs[j], size) for j, size in enumerate(sizes)]
        self.head = (int(p.func), p.gridDimX, p.gridDimY, p.gridDimZ, p.blockDimX, p.blockDimY, p.blockDimZ,
                     p.sharedMemBytes)
        self.words = []  # (param, byte offset, range index, offset in the range)
        for j, b in enumerate(self.values):
            for o in range(0, len(b) - WORD + 1, WORD):
                hit = _moved(int.from_bytes(b[o:o + WORD], "little"), ranges)
                if hit is not None:
                    self.words.append((j, o, *hit))
        self._params = None

    def _rewritten(self, bases) -> list:
        values = [bytearray(v) for v in self.values]
        for j, o, r, off in self.words:
            values[j][o:o + WORD] = (bases[r] + off).to_bytes(WORD, "little")
        return values

    def describe(self, bases):
        return self.head, tuple(bytes(v) for v in self._rewritten(bases))

    def set(self, exec_, node, bases, ctx) -> None:
        drv = driver()
        if self._params is None:  # the node's own parameter struct, pointing at buffers this object owns
            p = check(drv.cuGraphKernelNodeGetParams(node), "cuGraphKernelNodeGetParams")
            self._bufs = [ctypes.create_string_buffer(bytes(v), len(v)) for v in self.values]
            self._array = (ctypes.c_void_p * len(self._bufs))(*[ctypes.addressof(b) for b in self._bufs])
            p.kernelParams = ctypes.addressof(self._array)
            self._params = p
        for j, o, r, off in self.words:
            ctypes.memmove(ctypes.addressof(self._bufs[j]) + o, (bases[r] + off).to_bytes(WORD, "little"), WORD)
        check(drv.cuGraphExecKernelNodeSetParams(exec_, node, self._params), "cuGraphExecKernelNodeSetParams")


class _MemcpyNode:
    """A copy node: its source and destination where they are a range's, and whether it reads host memory."""

    def __init__(self, node, ranges):
        drv = driver()
        self.params = m = check(drv.cuGraphMemcpyNodeGetParams(node), "cuGraphMemcpyNodeGetParams")
        M = drv.CUmemorytype
        src_type = m.srcMemoryType
        if src_type == M.CU_MEMORYTYPE_UNIFIED:
            src_type = _memory_type(int(m.srcDevice))
        self.from_host = src_type in (M.CU_MEMORYTYPE_HOST, M.CU_MEMORYTYPE_ARRAY) or _num(m.srcHost) != 0
        self.words = [(f, *hit) for f, v in (("srcDevice", int(m.srcDevice)), ("dstDevice", int(m.dstDevice)))
                      if (hit := _moved(v, ranges)) is not None]
        self.head = tuple(_num(getattr(m, k)) for k in (
            "srcXInBytes", "srcY", "srcZ", "srcLOD", "srcPitch", "srcHeight", "dstXInBytes", "dstY", "dstZ",
            "dstLOD", "dstPitch", "dstHeight", "WidthInBytes", "Height", "Depth", "dstHost"))
        self.addrs = {"srcDevice": int(m.srcDevice), "dstDevice": int(m.dstDevice)}

    def describe(self, bases):
        addrs = dict(self.addrs)
        for f, r, off in self.words:
            addrs[f] = bases[r] + off
        return self.head, addrs["srcDevice"], addrs["dstDevice"]

    def set(self, exec_, node, bases, ctx) -> None:
        for f, r, off in self.words:
            setattr(self.params, f, bases[r] + off)
        check(driver().cuGraphExecMemcpyNodeSetParams(exec_, node, self.params, ctx),
              "cuGraphExecMemcpyNodeSetParams")


class _MemsetNode:
    def __init__(self, node, ranges):
        self.params = m = check(driver().cuGraphMemsetNodeGetParams(node), "cuGraphMemsetNodeGetParams")
        hit = _moved(int(m.dst), ranges)
        self.words = [hit] if hit is not None else []
        self.head = (int(m.dst), int(m.pitch), int(m.value), int(m.elementSize), int(m.width), int(m.height))

    def describe(self, bases):
        if not self.words:
            return self.head
        r, off = self.words[0]
        return (bases[r] + off, *self.head[1:])

    def set(self, exec_, node, bases, ctx) -> None:
        r, off = self.words[0]
        self.params.dst = bases[r] + off
        check(driver().cuGraphExecMemsetNodeSetParams(exec_, node, self.params, ctx),
              "cuGraphExecMemsetNodeSetParams")


class _BatchMemOpNode:
    """Stream memory operations (flag writes and waits): their addresses and values, never rewritten."""

    def __init__(self, node):
        drv = driver()
        p = check(drv.cuGraphBatchMemOpNodeGetParams(node), "cuGraphBatchMemOpNodeGetParams")
        kinds = drv.CUstreamBatchMemOpType
        wait, write = int(kinds.CU_STREAM_MEM_OP_WAIT_VALUE_32), int(kinds.CU_STREAM_MEM_OP_WRITE_VALUE_32)
        ops, self.unknown = [], False
        for op in list(p.paramArray)[:p.count]:
            kind = int(op.operation)
            if kind not in (wait, write):
                self.unknown = True
                continue
            part = op.waitValue if kind == wait else op.writeValue
            ops.append((kind, _num(part.address), _num(part.value), _num(part.flags)))
        self.ops = tuple(ops)
        self.addresses = [o[1] for o in ops if len(o) > 1]

    def describe(self, bases):
        return self.ops


def _num(x) -> int:
    """A driver struct's field as an int (None for a null pointer)."""
    return 0 if x is None else int(x)


def _memory_type(ptr: int):
    drv = driver()
    attr = drv.CUpointer_attribute.CU_POINTER_ATTRIBUTE_MEMORY_TYPE
    err, value = drv.cuPointerGetAttribute(attr, ptr)
    if int(err) != 0:  # not memory CUDA knows: pageable host memory
        return drv.CUmemorytype.CU_MEMORYTYPE_HOST
    return drv.CUmemorytype(value) if not isinstance(value, drv.CUmemorytype) else value


__all__ = ["GraphPatch"]
