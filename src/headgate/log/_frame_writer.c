/*
 * headgate.log._frame_writer: the stream log's frame write, in C.
 *
 * One function, write_frame(), does what the pure-Python fast path of
 * StreamLog.append does, byte for byte (see frame.py for the header and
 * LOG.md, "Ordering"). A frame goes to the term file one of two ways.
 *
 * Through the descriptor (the term argument is an int; how StreamLog writes
 * every frame with a payload of 1 KiB or more):
 *
 *   1. one pwritev on the term file's descriptor of the whole frame: the
 *      commit word (length | crc32 << 32) at byte 0, header bytes 8..40
 *      (type, flags, version, record count, producer id, first sequence,
 *      timestamp), little-endian, the payload at byte 40, and zeros up to
 *      the next multiple of 8;
 *   2. optionally the published position, one aligned 8-byte store with
 *      release ordering into the metadata page (a mapping).
 *
 * Readers act only on frames below the published position, and check each
 * frame's checksum; recovery cuts the log at the first frame whose checksum
 * fails. So the commit word need not reach the page cache after the rest.
 *
 * Into the mapping (the term argument is a writable buffer, the mapped term;
 * how StreamLog writes smaller frames, where a system call would cost more
 * than the copy):
 *
 *   1. header bytes 8..40 and the payload, with memcpy;
 *   2. the commit word at byte 0, one aligned 8-byte store with release
 *      ordering, after every other byte of the frame;
 *   3. optionally the published position, as above.
 *
 * The term is written through its descriptor, not through its mapping:
 * stores into a shared mapping fault on every page that a group commit has
 * just written back (the kernel write-protects it), and those faults wait
 * behind the file system's own work; on the machine we measure, they made
 * the group commit's fdatasync, and so the acks, stall for tens of
 * milliseconds every few terms. pwrite copies into the same page cache that
 * the readers map.
 *
 * The CRC-32 covers bytes [8, length) of the frame and starts from the seed
 * (position ^ position >> 32) & 0xffffffff, exactly as zlib.crc32(data, seed).
 *
 * Everything is validated before the first write: a bad argument raises and
 * leaves the file untouched. Header fields out of range raise
 * headgate.log.errors.LogError ("frame header field out of range: ..."), as
 * the Python path does; offsets outside the term, and a metadata page too
 * small, misaligned or read-only, raise ValueError. A failed write raises
 * OSError; nothing is published, and the caller scrubs what may have been
 * written (StreamLog._write_failed).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>
#include <zlib.h>
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "headgate.log._frame_writer stores little-endian words natively; little-endian hosts only"
#endif

#define HEADER_LENGTH 40
#define TYPE_OFFSET 8
#define FRAME_ALIGNMENT 8
#define DATA_FRAME 0x0001
#define FORMAT_VERSION 1
#define MAX_FRAME_LENGTH 0xFFFFFFFFull
/* Payloads from this size on are stored into a mapping with the GIL released. */
#define GIL_RELEASE_THRESHOLD 4096

static PyObject *log_error; /* headgate.log.errors.LogError */

/* An integer argument that is not a header field: offset, position, limit. */
static int
as_i64(PyObject *obj, const char *name, long long *out)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (value == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow) {
        PyErr_Format(PyExc_ValueError, "%s is out of the signed 64-bit range", name);
        return -1;
    }
    *out = value;
    return 0;
}

/* A header field: any integer (or __index__ object) within [low, high]. */
static int
field_error(const char *name, PyObject *obj, const char *range)
{
    PyErr_Clear();
    PyErr_Format(log_error, "frame header field out of range: %s %R is not %s", name, obj,
                 range);
    return -1;
}

static int
as_u64_field(PyObject *obj, const char *name, uint64_t high, const char *range,
             uint64_t *out)
{
    PyObject *index = PyNumber_Index(obj);
    if (index == NULL) {
        return field_error(name, obj, range);
    }
    /* OverflowError for a negative value too. */
    unsigned long long value = PyLong_AsUnsignedLongLong(index);
    Py_DECREF(index);
    if ((value == (unsigned long long)-1 && PyErr_Occurred()) || value > high) {
        return field_error(name, obj, range);
    }
    *out = value;
    return 0;
}

static int
as_i64_field(PyObject *obj, const char *name, int64_t *out)
{
    PyObject *index = PyNumber_Index(obj);
    if (index == NULL) {
        return field_error(name, obj, "a signed 64-bit integer");
    }
    int overflow = 0;
    long long value = PyLong_AsLongLongAndOverflow(index, &overflow);
    Py_DECREF(index);
    if (overflow || (value == -1 && PyErr_Occurred())) {
        return field_error(name, obj, "a signed 64-bit integer");
    }
    *out = value;
    return 0;
}

/* A writable buffer with room for 8 bytes at `offset`, 8-aligned there. */
static int
get_page(PyObject *obj, long long offset, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "meta must be a writable buffer, not %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (offset < 0 || offset % FRAME_ALIGNMENT != 0 || view->len < 8 || offset > view->len - 8 ||
        ((uintptr_t)((char *)view->buf + offset)) % FRAME_ALIGNMENT != 0) {
        PyErr_Format(PyExc_ValueError,
                     "meta: 8 bytes at offset %lld do not fit an aligned place in %zd bytes",
                     offset, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* Write all of iov (count buffers, total bytes) at `at`, resuming after short
 * writes and EINTR. Returns 0, or -1 with errno set. */
static int
pwrite_all(int fd, struct iovec *iov, int count, size_t total, off_t at)
{
    while (total > 0) {
        ssize_t done = pwritev(fd, iov, count, at);
        if (done < 0) {
            if (errno == EINTR) {
                continue;
            }
            return -1;
        }
        if (done == 0) {
            errno = EIO;
            return -1;
        }
        total -= (size_t)done;
        at += done;
        while (count > 0 && (size_t)done >= iov->iov_len) {
            done -= (ssize_t)iov->iov_len;
            iov++;
            count--;
        }
        if (count > 0) {
            iov->iov_base = (char *)iov->iov_base + done;
            iov->iov_len -= (size_t)done;
        }
    }
    return 0;
}

PyDoc_STRVAR(write_frame_doc,
"write_frame(term, term_size, offset, position, limit, payload, producer_id,\n"
"            first_sequence, record_count, timestamp_us, meta, published_offset,\n"
"            result_type)\n"
"\n"
"Write one data frame at byte `offset` of a term of `term_size` bytes: `term`\n"
"is the term file's descriptor (pwritev) or a writable buffer of the mapped\n"
"term (stores, commit word last). `position` is the frame's stream position.\n"
"Returns its end\n"
"position (position + the frame's aligned length), or, if `result_type` (a\n"
"tuple subclass such as AppendResult) is not None,\n"
"result_type((position, end)). If that end exceeds `limit`, write nothing and\n"
"return 0 (None with a result_type). Then, unless `meta` is None, the end position is\n"
"stored at byte `published_offset` of `meta`, with release ordering. A failed\n"
"write raises OSError and publishes nothing.");

static PyObject *
write_frame(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 13) {
        PyErr_Format(PyExc_TypeError, "write_frame() takes 13 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *result_type = args[12];
    if (result_type != Py_None &&
        !(PyType_Check(result_type) &&
          PyType_FastSubclass((PyTypeObject *)result_type, Py_TPFLAGS_TUPLE_SUBCLASS))) {
        PyErr_SetString(PyExc_TypeError, "result_type must be None or a subclass of tuple");
        return NULL;
    }
    long long fd = -1, term_size, offset, position, limit, published_offset = 0;
    /* An int is the term file's descriptor (pwrite); anything else must be
     * a writable buffer of the mapped term (stores). */
    int to_fd = PyLong_Check(args[0]);
    if ((to_fd && as_i64(args[0], "fd", &fd) < 0) ||
        as_i64(args[1], "term_size", &term_size) < 0 || as_i64(args[2], "offset", &offset) < 0 ||
        as_i64(args[3], "position", &position) < 0 || as_i64(args[4], "limit", &limit) < 0) {
        return NULL;
    }
    if (to_fd && (fd < 0 || fd > INT_MAX)) {
        PyErr_Format(PyExc_ValueError, "fd %lld is not a file descriptor", fd);
        return NULL;
    }
    if (position < 0 || (position & (FRAME_ALIGNMENT - 1)) != 0) {
        PyErr_Format(PyExc_ValueError, "position %lld is not a non-negative multiple of 8",
                     position);
        return NULL;
    }
    PyObject *meta = args[10];
    if (meta != Py_None && as_i64(args[11], "published_offset", &published_offset) < 0) {
        return NULL;
    }

    Py_buffer payload;
    if (PyObject_GetBuffer(args[5], &payload, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    unsigned long long length = (unsigned long long)payload.len + HEADER_LENGTH;
    if (length > MAX_FRAME_LENGTH) {
        PyBuffer_Release(&payload);
        PyErr_Format(PyExc_ValueError, "a payload of %zd bytes does not fit a frame",
                     payload.len);
        return NULL;
    }
    long long cost = (long long)((length + FRAME_ALIGNMENT - 1) & ~(unsigned long long)7);
    if (position > LLONG_MAX - cost) {
        PyBuffer_Release(&payload);
        PyErr_SetString(PyExc_ValueError, "the frame would end past the largest position");
        return NULL;
    }
    long long end = position + cost;
    if (end > limit) {
        PyBuffer_Release(&payload);
        if (result_type != Py_None) {
            Py_RETURN_NONE;
        }
        return PyLong_FromLong(0);
    }
    if (offset < 0 || offset % FRAME_ALIGNMENT != 0 || term_size < 0 || cost > term_size ||
        offset > term_size - cost) {
        PyBuffer_Release(&payload);
        PyErr_Format(PyExc_ValueError,
                     "term: %lld bytes at offset %lld do not fit an aligned place in %lld bytes",
                     cost, offset, term_size);
        return NULL;
    }
    Py_buffer term;
    if (!to_fd) {
        if (PyObject_GetBuffer(args[0], &term, PyBUF_WRITABLE) < 0) {
            PyErr_Clear();
            PyBuffer_Release(&payload);
            PyErr_Format(PyExc_ValueError,
                         "term must be a file descriptor or a writable buffer, not %.100s",
                         Py_TYPE(args[0])->tp_name);
            return NULL;
        }
        if (term.len < term_size ||
            ((uintptr_t)((char *)term.buf + offset)) % FRAME_ALIGNMENT != 0) {
            PyErr_Format(PyExc_ValueError,
                         "term: a buffer of %zd bytes, not 8-byte aligned at offset %lld, "
                         "for a term of %lld",
                         term.len, offset, term_size);
            PyBuffer_Release(&term);
            PyBuffer_Release(&payload);
            return NULL;
        }
    }

    uint64_t producer_id, first_sequence, record_count;
    int64_t timestamp_us;
    if (as_u64_field(args[6], "producer_id", UINT64_MAX, "an unsigned 64-bit integer",
                     &producer_id) < 0 ||
        as_u64_field(args[7], "first_sequence", UINT64_MAX, "an unsigned 64-bit integer",
                     &first_sequence) < 0 ||
        as_u64_field(args[8], "record_count", UINT32_MAX, "an unsigned 32-bit integer",
                     &record_count) < 0 ||
        as_i64_field(args[9], "timestamp_us", &timestamp_us) < 0) {
        if (!to_fd) {
            PyBuffer_Release(&term);
        }
        PyBuffer_Release(&payload);
        return NULL;
    }

    Py_buffer page;
    if (meta != Py_None && get_page(meta, published_offset, &page) < 0) {
        if (!to_fd) {
            PyBuffer_Release(&term);
        }
        PyBuffer_Release(&payload);
        return NULL;
    }
    /* The result exists before the first write: once the frame is committed,
     * nothing may fail, or the caller would not learn that it was. */
    PyObject *result = PyLong_FromLongLong(end);
    if (result != NULL && result_type != Py_None) {
        PyObject *start = PyLong_FromLongLong(position);
        PyObject *pair = start == NULL
                             ? NULL
                             : ((PyTypeObject *)result_type)
                                   ->tp_alloc((PyTypeObject *)result_type, 2);
        if (pair == NULL) {
            Py_XDECREF(start);
            Py_CLEAR(result);
        }
        else {
            PyTuple_SET_ITEM(pair, 0, start);
            PyTuple_SET_ITEM(pair, 1, result);
            result = pair;
        }
    }
    if (result == NULL) {
        if (meta != Py_None) {
            PyBuffer_Release(&page);
        }
        if (!to_fd) {
            PyBuffer_Release(&term);
        }
        PyBuffer_Release(&payload);
        return NULL;
    }

    unsigned char header[HEADER_LENGTH];
    unsigned char *body = header + TYPE_OFFSET;
    uint16_t frame_type = DATA_FRAME;
    uint32_t count = (uint32_t)record_count;
    memcpy(body + 0, &frame_type, 2);
    body[2] = 0;              /* flags */
    body[3] = FORMAT_VERSION; /* version */
    memcpy(body + 4, &count, 4);
    memcpy(body + 8, &producer_id, 8);
    memcpy(body + 16, &first_sequence, 8);
    memcpy(body + 24, &timestamp_us, 8);
    static const unsigned char zeros[FRAME_ALIGNMENT];
    uint32_t seed = (uint32_t)(((uint64_t)position ^ ((uint64_t)position >> 32)) & 0xFFFFFFFFu);

    if (!to_fd) {
        /* Stores into the mapped term (small frames): the body, then the
         * commit word with release ordering, then the published position.
         * A large payload is copied without the GIL; the exported buffers
         * keep the map and the payload alive meanwhile. */
        unsigned char *frame = (unsigned char *)term.buf + offset;
        PyThreadState *unlocked = NULL;
        if (payload.len >= GIL_RELEASE_THRESHOLD) {
            unlocked = PyEval_SaveThread();
        }
        memcpy(frame + TYPE_OFFSET, body, HEADER_LENGTH - TYPE_OFFSET);
        /* memmove: a hostile payload may be a view of the same map. */
        memmove(frame + HEADER_LENGTH, payload.buf, (size_t)payload.len);
        uint32_t sum = (uint32_t)crc32(seed, frame + TYPE_OFFSET, (uInt)(length - TYPE_OFFSET));
        __atomic_store_n((uint64_t *)frame, (uint64_t)length | ((uint64_t)sum << 32),
                         __ATOMIC_RELEASE);
        if (meta != Py_None) {
            __atomic_store_n((int64_t *)((unsigned char *)page.buf + published_offset),
                             (int64_t)end, __ATOMIC_RELEASE);
        }
        if (unlocked != NULL) {
            PyEval_RestoreThread(unlocked);
        }
        if (meta != Py_None) {
            PyBuffer_Release(&page);
        }
        PyBuffer_Release(&term);
        PyBuffer_Release(&payload);
        return result;
    }

    /* Without the GIL, as os.pwrite does: a write may block in the kernel
     * (page allocation, dirty-page throttling), and the log's other threads
     * (group commit, term preparer) must not wait for it. The exported
     * payload buffer stays valid meanwhile. */
    PyThreadState *saved = PyEval_SaveThread();
    uLong crc = crc32(seed, body, (uInt)(HEADER_LENGTH - TYPE_OFFSET));
    if (payload.len > 0) { /* crc32() with a NULL buffer would return 0, not crc */
        crc = crc32(crc, (const Bytef *)payload.buf, (uInt)payload.len);
    }
    uint64_t commit = (uint64_t)length | ((uint64_t)(uint32_t)crc << 32);
    memcpy(header, &commit, sizeof commit);
    struct iovec frame[3] = {
        {header, sizeof header},
        {payload.buf, (size_t)payload.len},
        {(void *)zeros, (size_t)((unsigned long long)cost - length)},
    };
    int failed = pwrite_all((int)fd, frame, 3, (size_t)cost, (off_t)offset) < 0;
    int saved_errno = errno;
    if (!failed && meta != Py_None) {
        __atomic_store_n((int64_t *)((unsigned char *)page.buf + published_offset),
                         (int64_t)end, __ATOMIC_RELEASE);
    }
    PyEval_RestoreThread(saved);
    if (meta != Py_None) {
        PyBuffer_Release(&page);
    }
    PyBuffer_Release(&payload);
    if (failed) {
        Py_DECREF(result);
        errno = saved_errno;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return result;
}

static PyMethodDef methods[] = {
    {"write_frame", (PyCFunction)(void (*)(void))write_frame, METH_FASTCALL, write_frame_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    "headgate.log._frame_writer",
    "The stream log's frame write in C (optional; headgate.log falls back to Python).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__frame_writer(void)
{
    PyObject *errors = PyImport_ImportModule("headgate.log.errors");
    if (errors == NULL) {
        return NULL;
    }
    PyObject *error = PyObject_GetAttrString(errors, "LogError");
    Py_DECREF(errors);
    if (error == NULL) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) {
        Py_DECREF(error);
        return NULL;
    }
    Py_XSETREF(log_error, error);
    return module;
}
