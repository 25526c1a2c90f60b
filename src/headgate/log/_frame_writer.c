/*
 * headgate.log._frame_writer: the stream log's frame write, in C.
 *
 * One function, write_frame(), does what the pure-Python fast path of
 * StreamLog.append does, byte for byte (see frame.py for the header and
 * LOG.md, "Ordering"):
 *
 *   1. header bytes 8..40 (type, flags, version, record count, producer id,
 *      first sequence, timestamp), little-endian;
 *   2. the payload, at byte 40;
 *   3. the commit word (length | crc32 << 32) at byte 0, one aligned 8-byte
 *      store with release ordering, after every other byte of the frame;
 *   4. optionally the published position, one aligned 8-byte store with
 *      release ordering into the metadata page.
 *
 * The CRC-32 covers bytes [8, length) of the frame and starts from the seed
 * (position ^ position >> 32) & 0xffffffff, exactly as zlib.crc32(data, seed).
 *
 * Everything is validated before the first byte is written: a bad argument
 * raises and leaves the maps untouched. Header fields out of range raise
 * headgate.log.errors.LogError ("frame header field out of range: ..."), as
 * the Python path does; buffers too small, misaligned or read-only, and
 * offsets outside them, raise ValueError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
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
/* Payloads from this size on are written with the GIL released. */
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

/* A writable buffer with room for `need` bytes at `offset`, 8-aligned there. */
static int
get_target(PyObject *obj, const char *name, long long offset, long long need,
           Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_WRITABLE) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be a writable buffer, not %.100s", name,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    if (offset < 0 || offset % FRAME_ALIGNMENT != 0 || need > view->len ||
        offset > view->len - need) {
        PyErr_Format(PyExc_ValueError,
                     "%s: %lld bytes at offset %lld do not fit an aligned place in %zd bytes",
                     name, need, offset, view->len);
        PyBuffer_Release(view);
        return -1;
    }
    if (((uintptr_t)((char *)view->buf + offset)) % FRAME_ALIGNMENT != 0) {
        PyErr_Format(PyExc_ValueError, "%s: offset %lld is not 8-byte aligned in memory",
                     name, offset);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(write_frame_doc,
"write_frame(term, offset, position, limit, payload, producer_id, first_sequence,\n"
"            record_count, timestamp_us, meta, published_offset, result_type)\n"
"\n"
"Write one data frame at byte `offset` of the writable buffer `term`, for the\n"
"stream position `position`, and return its end position\n"
"(position + the frame's aligned length), or, if `result_type` (a tuple\n"
"subclass such as AppendResult) is not None, result_type((position, end)).\n"
"If that end exceeds `limit`, write nothing and return 0 (None with a\n"
"result_type). The commit word is stored last, with release\n"
"ordering; then, unless `meta` is None, the end position is stored at byte\n"
"`published_offset` of `meta`, with release ordering.");

static PyObject *
write_frame(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 12) {
        PyErr_Format(PyExc_TypeError, "write_frame() takes 12 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *result_type = args[11];
    if (result_type != Py_None &&
        !(PyType_Check(result_type) &&
          PyType_FastSubclass((PyTypeObject *)result_type, Py_TPFLAGS_TUPLE_SUBCLASS))) {
        PyErr_SetString(PyExc_TypeError, "result_type must be None or a subclass of tuple");
        return NULL;
    }
    long long offset, position, limit, published_offset = 0;
    if (as_i64(args[1], "offset", &offset) < 0 || as_i64(args[2], "position", &position) < 0 ||
        as_i64(args[3], "limit", &limit) < 0) {
        return NULL;
    }
    if (position < 0 || (position & (FRAME_ALIGNMENT - 1)) != 0) {
        PyErr_Format(PyExc_ValueError, "position %lld is not a non-negative multiple of 8",
                     position);
        return NULL;
    }
    PyObject *meta = args[9];
    if (meta != Py_None && as_i64(args[10], "published_offset", &published_offset) < 0) {
        return NULL;
    }

    Py_buffer payload;
    if (PyObject_GetBuffer(args[4], &payload, PyBUF_SIMPLE) < 0) {
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

    uint64_t producer_id, first_sequence, record_count;
    int64_t timestamp_us;
    if (as_u64_field(args[5], "producer_id", UINT64_MAX, "an unsigned 64-bit integer",
                     &producer_id) < 0 ||
        as_u64_field(args[6], "first_sequence", UINT64_MAX, "an unsigned 64-bit integer",
                     &first_sequence) < 0 ||
        as_u64_field(args[7], "record_count", UINT32_MAX, "an unsigned 32-bit integer",
                     &record_count) < 0 ||
        as_i64_field(args[8], "timestamp_us", &timestamp_us) < 0) {
        PyBuffer_Release(&payload);
        return NULL;
    }

    Py_buffer term, page;
    if (get_target(args[0], "term", offset, (long long)length, &term) < 0) {
        PyBuffer_Release(&payload);
        return NULL;
    }
    if (meta != Py_None && get_target(meta, "meta", published_offset, 8, &page) < 0) {
        PyBuffer_Release(&term);
        PyBuffer_Release(&payload);
        return NULL;
    }
    /* The result exists before the first store: once the frame is written,
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
        PyBuffer_Release(&term);
        PyBuffer_Release(&payload);
        return NULL;
    }

    /* Nothing can fail from here on: write the frame. A large frame is
     * written without the GIL, as zlib.crc32 does for large inputs, so that
     * the log's other threads (group commit, term preparer) are not held up;
     * the exported buffers keep the maps and the payload alive meanwhile. */
    unsigned char *frame = (unsigned char *)term.buf + offset;
    PyThreadState *saved = NULL;
    if (payload.len >= GIL_RELEASE_THRESHOLD) {
        saved = PyEval_SaveThread();
    }
    unsigned char body[HEADER_LENGTH - TYPE_OFFSET];
    uint16_t frame_type = DATA_FRAME;
    uint32_t count = (uint32_t)record_count;
    memcpy(body + 0, &frame_type, 2);
    body[2] = 0;              /* flags */
    body[3] = FORMAT_VERSION; /* version */
    memcpy(body + 4, &count, 4);
    memcpy(body + 8, &producer_id, 8);
    memcpy(body + 16, &first_sequence, 8);
    memcpy(body + 24, &timestamp_us, 8);
    memcpy(frame + TYPE_OFFSET, body, sizeof body);
    /* memmove: a hostile payload may be a view of the same map. */
    memmove(frame + HEADER_LENGTH, payload.buf, (size_t)payload.len);
    uint32_t seed = (uint32_t)(((uint64_t)position ^ ((uint64_t)position >> 32)) & 0xFFFFFFFFu);
    uint32_t crc = (uint32_t)crc32(seed, frame + TYPE_OFFSET, (uInt)(length - TYPE_OFFSET));
    uint64_t commit = (uint64_t)length | ((uint64_t)crc << 32);
    __atomic_store_n((uint64_t *)frame, commit, __ATOMIC_RELEASE);
    if (meta != Py_None) {
        __atomic_store_n((int64_t *)((unsigned char *)page.buf + published_offset),
                         (int64_t)end, __ATOMIC_RELEASE);
    }
    if (saved != NULL) {
        PyEval_RestoreThread(saved);
    }
    if (meta != Py_None) {
        PyBuffer_Release(&page);
    }
    PyBuffer_Release(&term);
    PyBuffer_Release(&payload);
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
