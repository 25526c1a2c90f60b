/*
 * Benchmark instrument: count calls into CPython's memory allocators.
 *
 * tracemalloc hooks the allocators (PEP 445) to record live blocks and their
 * tracebacks, but keeps no count of allocation events.  This module installs a
 * hook the same way, in front of whatever is installed (tracemalloc included),
 * and counts every malloc, calloc and realloc in the three domains (raw, mem,
 * object) with the bytes asked for.  Frees pass through uncounted.
 *
 * Built on demand by bench/alloccount.py; never part of the package.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

typedef struct {
    PyMemAllocatorEx next;
    unsigned long long calls;
    unsigned long long bytes;
} Hook;

static Hook hooks[3];
static const PyMemAllocatorDomain domains[3] = {
    PYMEM_DOMAIN_RAW, PYMEM_DOMAIN_MEM, PYMEM_DOMAIN_OBJ};
static int installed;

static inline void count(Hook *hook, size_t size)
{
    /* The raw domain may be called without the GIL. */
    __atomic_fetch_add(&hook->calls, 1, __ATOMIC_RELAXED);
    __atomic_fetch_add(&hook->bytes, (unsigned long long)size, __ATOMIC_RELAXED);
}

static void *hook_malloc(void *ctx, size_t size)
{
    Hook *hook = ctx;
    count(hook, size);
    return hook->next.malloc(hook->next.ctx, size);
}

static void *hook_calloc(void *ctx, size_t nelem, size_t elsize)
{
    Hook *hook = ctx;
    count(hook, nelem * elsize);
    return hook->next.calloc(hook->next.ctx, nelem, elsize);
}

static void *hook_realloc(void *ctx, void *ptr, size_t new_size)
{
    Hook *hook = ctx;
    count(hook, new_size);
    return hook->next.realloc(hook->next.ctx, ptr, new_size);
}

static void hook_free(void *ctx, void *ptr)
{
    Hook *hook = ctx;
    hook->next.free(hook->next.ctx, ptr);
}

static PyObject *install(PyObject *self, PyObject *unused)
{
    if (installed) {
        Py_RETURN_FALSE;
    }
    for (int i = 0; i < 3; i++) {
        PyMem_GetAllocator(domains[i], &hooks[i].next);
    }
    for (int i = 0; i < 3; i++) {
        PyMemAllocatorEx mine = {&hooks[i], hook_malloc, hook_calloc, hook_realloc, hook_free};
        PyMem_SetAllocator(domains[i], &mine);
    }
    installed = 1;
    Py_RETURN_TRUE;
}

static PyObject *counts(PyObject *self, PyObject *unused)
{
    unsigned long long calls = 0, bytes = 0;
    for (int i = 0; i < 3; i++) {
        calls += __atomic_load_n(&hooks[i].calls, __ATOMIC_RELAXED);
        bytes += __atomic_load_n(&hooks[i].bytes, __ATOMIC_RELAXED);
    }
    return Py_BuildValue("(KK)", calls, bytes);
}

static PyMethodDef methods[] = {
    {"install", install, METH_NOARGS,
     "Install the counting hook in front of the current allocators (once; "
     "True if this call installed it)."},
    {"counts", counts, METH_NOARGS,
     "(calls, bytes): allocator calls (malloc, calloc, realloc; all domains) "
     "and the bytes they asked for, since install()."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_alloc_hook", "Count calls into CPython's allocators.", -1, methods,
};

PyMODINIT_FUNC PyInit__alloc_hook(void) { return PyModule_Create(&module); }
