/* flowdecision._otlp: one finished span as an OTLP protobuf ``Span`` field, in C.
 *
 * Why: encoding a span in Python was two thirds of what tracing costs a traced
 * POST (docs/BENCHMARKS.md, "Tracing overhead": on vs off 0.77x with the
 * Python encoder, 0.86-0.90x with encoding taken away), all of it on the
 * service's one interpreter. This writes the same bytes as tracer._span for
 * the spans a service ends most (text, integer, boolean and float attributes,
 * links without attributes, no events, no trace state) and returns None for
 * anything else, which tracer.py then encodes in Python. Optional: without a
 * compiler the package installs without it and tracer.py encodes everything.
 * tests/test_tracer.py compares its bytes with the Python encoder's and the
 * SDK's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* Set by configure(): SpanKind members by value, StatusCode members by value,
 * the tracer's unset Status and empty TraceState (compared by identity). */
static PyObject *kinds[5];
static PyObject *codes[3];
static PyObject *unset_status;
static PyObject *empty_state;
static int configured;

static PyObject *s_context, *s_parent, *s_name, *s_kind, *s_start_time, *s_end_time,
    *s_attributes, *s_dropped_attributes, *s_events, *s_dropped_events, *s_links,
    *s_dropped_links, *s_status, *s_status_code, *s_description;

/* A growing output buffer; `fallback` set means "not encodable here". Once
 * `failed` or `fallback` is set every step below does nothing: none calls into
 * Python with an exception pending (which would turn, say, a MemoryError into
 * a SystemError) or clears the exception the failure set. */
typedef struct {
    unsigned char *data;
    Py_ssize_t len, cap;
    unsigned char stack[1024];
    int failed;   /* a Python error is set */
    int fallback; /* leave this span to the Python encoder */
} Out;

static int grow(Out *out, Py_ssize_t need) {
    if (out->len + need <= out->cap)
        return 0;
    Py_ssize_t cap = out->cap * 2;
    while (cap < out->len + need)
        cap *= 2;
    unsigned char *data;
    if (out->data == out->stack) {
        data = PyMem_Malloc(cap);
        if (data != NULL)
            memcpy(data, out->stack, out->len);
    } else {
        data = PyMem_Realloc(out->data, cap);
    }
    if (data == NULL) {
        PyErr_NoMemory();
        out->failed = 1;
        return -1;
    }
    out->data = data;
    out->cap = cap;
    return 0;
}

static int stopped(const Out *out) { return out->failed || out->fallback; }

static void put(Out *out, const void *bytes, Py_ssize_t n) {
    if (stopped(out) || grow(out, n) < 0)
        return;
    memcpy(out->data + out->len, bytes, n);
    out->len += n;
}

static void put_byte(Out *out, unsigned char b) { put(out, &b, 1); }

static void put_varint(Out *out, uint64_t v) {
    unsigned char buf[10];
    Py_ssize_t n = 0;
    while (v > 127) {
        buf[n++] = (unsigned char)((v & 127) | 128);
        v >>= 7;
    }
    buf[n++] = (unsigned char)v;
    put(out, buf, n);
}

static void put_be64(Out *out, uint64_t v) {
    unsigned char buf[8];
    for (int i = 7; i >= 0; i--) {
        buf[i] = (unsigned char)(v & 0xFF);
        v >>= 8;
    }
    put(out, buf, 8);
}

static void put_le64(Out *out, uint64_t v) {
    unsigned char buf[8];
    for (int i = 0; i < 8; i++) {
        buf[i] = (unsigned char)(v & 0xFF);
        v >>= 8;
    }
    put(out, buf, 8);
}

/* Reserve room for a length prefix (at most 5 bytes) and return where the
 * message starts; finish() moves the message back over unused room. */
static Py_ssize_t open_field(Out *out, unsigned char tag) {
    put_byte(out, tag);
    Py_ssize_t at = out->len;
    put(out, "\0\0\0\0\0", 5);
    return at;
}

static void close_field(Out *out, Py_ssize_t at) {
    if (stopped(out))
        return;
    Py_ssize_t body = out->len - at - 5;
    unsigned char buf[10];
    Py_ssize_t n = 0;
    uint64_t v = (uint64_t)body;
    while (v > 127) {
        buf[n++] = (unsigned char)((v & 127) | 128);
        v >>= 7;
    }
    buf[n++] = (unsigned char)v;
    memcpy(out->data + at, buf, n);
    memmove(out->data + at + n, out->data + at + 5, body);
    out->len = at + n + body;
}

static void give_up(Out *out) { out->fallback = 1; }

/* An unsigned 64-bit integer from a Python int (the times, the counts). */
static int as_u64(Out *out, PyObject *value, uint64_t *result) {
    if (stopped(out))
        return -1;
    if (!PyLong_Check(value)) {
        give_up(out);
        return -1;
    }
    *result = PyLong_AsUnsignedLongLong(value);
    if (*result == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        give_up(out);
        return -1;
    }
    return 0;
}

/* A trace id (128 bits) or span id (64 bits), big-endian, as OTLP writes ids; a
 * negative or wider id is left to Python (which refuses it, as the SDK does). */
static void put_id(Out *out, PyObject *value, int bytes) {
    if (stopped(out))
        return;
    if (!PyLong_Check(value)) {
        give_up(out);
        return;
    }
    uint64_t low;
    if (bytes == 16) {
        static PyObject *sixty_four;
        if (sixty_four == NULL && (sixty_four = PyLong_FromLong(64)) == NULL) {
            out->failed = 1;
            return;
        }
        PyObject *high = PyNumber_Rshift(value, sixty_four);
        if (high == NULL) {
            out->failed = 1;
            return;
        }
        uint64_t h = PyLong_AsUnsignedLongLong(high);
        Py_DECREF(high);
        if (h == (uint64_t)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            give_up(out);
            return;
        }
        put_be64(out, h);
        low = PyLong_AsUnsignedLongLongMask(value);
    } else {
        low = PyLong_AsUnsignedLongLong(value);
    }
    if (low == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        give_up(out);
        return;
    }
    put_be64(out, low);
}

/* UTF-8 of an exact str; NULL (and fallback) for anything else or a lone surrogate. */
static const char *text(Out *out, PyObject *value, Py_ssize_t *size) {
    if (stopped(out))
        return NULL;
    if (!PyUnicode_CheckExact(value)) {
        give_up(out);
        return NULL;
    }
    const char *raw = PyUnicode_AsUTF8AndSize(value, size);
    if (raw == NULL) {
        PyErr_Clear();
        give_up(out);
    }
    return raw;
}

static void put_text(Out *out, unsigned char tag, const char *raw, Py_ssize_t size) {
    put_byte(out, tag);
    put_varint(out, (uint64_t)size);
    put(out, raw, size);
}

/* Repeated KeyValue fields under `tag`, from an exact dict of scalar values. */
static void put_attributes(Out *out, unsigned char tag, PyObject *attributes) {
    if (stopped(out) || attributes == Py_None)
        return;
    if (!PyDict_CheckExact(attributes)) {
        give_up(out);
        return;
    }
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (!stopped(out) && PyDict_Next(attributes, &pos, &key, &value)) {
        Py_ssize_t key_size;
        const char *key_raw = text(out, key, &key_size);
        if (key_raw == NULL)
            return;
        Py_ssize_t kv = open_field(out, tag);
        put_text(out, 0x0A, key_raw, key_size);
        Py_ssize_t any = open_field(out, 0x12);
        if (PyUnicode_CheckExact(value)) {
            Py_ssize_t size;
            const char *raw = text(out, value, &size);
            if (raw == NULL)
                return;
            put_text(out, 0x0A, raw, size);
        } else if (PyBool_Check(value)) {
            put_byte(out, 0x10);
            put_byte(out, value == Py_True ? 1 : 0);
        } else if (PyLong_CheckExact(value)) {
            int overflow;
            long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
            uint64_t u;
            if (overflow == 0) {
                if (v == -1 && PyErr_Occurred()) {
                    out->failed = 1;
                    return;
                }
                u = (uint64_t)v; /* negative: two's complement, ten bytes */
            } else { /* past OTLP's int64: the Python encoder's (and the SDK's) case */
                give_up(out);
                return;
            }
            put_byte(out, 0x18);
            put_varint(out, u);
        } else if (PyFloat_CheckExact(value)) {
            double d = PyFloat_AS_DOUBLE(value);
            uint64_t bits;
            memcpy(&bits, &d, 8);
            put_byte(out, 0x21);
            put_le64(out, bits);
        } else {
            give_up(out);
            return;
        }
        close_field(out, any);
        close_field(out, kv);
    }
}

/* A non-zero count under `tag` (dropped attributes, events, links). */
static void put_count(Out *out, unsigned char tag, PyObject *owner, PyObject *name) {
    if (stopped(out))
        return;
    PyObject *count = PyObject_GetAttr(owner, name);
    if (count == NULL) {
        PyErr_Clear();
        give_up(out);
        return;
    }
    uint64_t n;
    if (as_u64(out, count, &n) == 0 && n) {
        put_byte(out, tag);
        put_varint(out, n);
    }
    Py_DECREF(count);
}

/* Each of `names` read from `owner` into `values` (new references); -1 (and the
 * span left to Python, which reports what is missing) if one is not there. */
static int read_fields(Out *out, PyObject *owner, PyObject **names, PyObject **values, int n) {
    for (int i = 0; i < n; i++) {
        values[i] = PyObject_GetAttr(owner, names[i]);
        if (values[i] == NULL) {
            for (int j = 0; j < i; j++)
                Py_DECREF(values[j]);
            PyErr_Clear();
            give_up(out);
            return -1;
        }
    }
    return 0;
}

/* A context's trace id and span id fields (the same tags in a Span and a Link). */
static void put_ids(Out *out, PyObject *context) {
    put(out, "\x0a\x10", 2);
    put_id(out, PyTuple_GET_ITEM(context, 0), 16);
    put(out, "\x12\x08", 2);
    put_id(out, PyTuple_GET_ITEM(context, 1), 8);
}

static const unsigned char HAS_REMOTE[4] = {0x00, 0x01, 0x00, 0x00};
static const unsigned char IS_REMOTE[4] = {0x00, 0x03, 0x00, 0x00};

static void put_link(Out *out, PyObject *link) {
    if (stopped(out))
        return;
    PyObject *names[2] = {s_context, s_attributes}, *fields[2];
    if (read_fields(out, link, names, fields, 2) < 0)
        return;
    PyObject *context = fields[0], *attributes = fields[1];
    int has_attributes = PyObject_IsTrue(attributes);
    if (has_attributes != 0 || !PyTuple_Check(context) || PyTuple_GET_SIZE(context) < 3) {
        if (has_attributes < 0)
            PyErr_Clear();
        give_up(out);
    } else {
        Py_ssize_t at = open_field(out, 0x6A);
        put_ids(out, context);
        put_count(out, 0x28, link, s_dropped_attributes);
        int remote = stopped(out) ? 0 : PyObject_IsTrue(PyTuple_GET_ITEM(context, 2));
        if (remote < 0) {
            out->failed = 1;
        } else {
            put_byte(out, 0x35);
            put(out, remote ? IS_REMOTE : HAS_REMOTE, 4);
        }
        close_field(out, at);
    }
    Py_DECREF(context);
    Py_DECREF(attributes);
}

static void put_status(Out *out, PyObject *status) {
    if (stopped(out))
        return;
    if (status == unset_status) {
        put(out, "\x7a\x00", 2);
        return;
    }
    PyObject *names[2] = {s_status_code, s_description}, *fields[2];
    if (read_fields(out, status, names, fields, 2) < 0)
        return;
    PyObject *code = fields[0], *description = fields[1];
    int value = -1;
    for (int i = 0; i < 3; i++)
        if (code == codes[i])
            value = i;
    if (value < 0 || (description != Py_None && !PyUnicode_CheckExact(description))) {
        give_up(out);
    } else {
        Py_ssize_t at = open_field(out, 0x7A);
        if (description != Py_None && PyUnicode_GET_LENGTH(description)) {
            Py_ssize_t size;
            const char *raw = text(out, description, &size);
            if (raw != NULL)
                put_text(out, 0x12, raw, size);
        }
        if (value) {
            put_byte(out, 0x18);
            put_byte(out, (unsigned char)value);
        }
        close_field(out, at);
    }
    Py_DECREF(code);
    Py_DECREF(description);
}

static PyObject *encode_span(PyObject *module, PyObject *span) {
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "flowdecision._otlp.configure() was not called");
        return NULL;
    }
    enum { CONTEXT, PARENT, NAME, KIND, START, END, ATTRIBUTES, EVENTS, LINKS, STATUS, N };
    PyObject *names[N] = {s_context, s_parent, s_name,   s_kind,  s_start_time,
                          s_end_time, s_attributes, s_events, s_links, s_status};
    PyObject *f[N];
    Out out = {0};
    out.data = out.stack;
    out.cap = sizeof(out.stack);
    if (read_fields(&out, span, names, f, N) < 0)
        Py_RETURN_NONE;
    PyObject *result = NULL;

    PyObject *ctx = f[CONTEXT], *parent = f[PARENT];
    if (!PyTuple_Check(ctx) || PyTuple_GET_SIZE(ctx) < 5 ||
        (parent != Py_None && (!PyTuple_Check(parent) || PyTuple_GET_SIZE(parent) < 3)) ||
        !PyList_Check(f[EVENTS]) || PyList_GET_SIZE(f[EVENTS]) || !PyList_Check(f[LINKS])) {
        give_up(&out);
        goto done;
    }
    PyObject *state = PyTuple_GET_ITEM(ctx, 4);
    if (state != empty_state && state != Py_None) {
        int has_state = PyObject_IsTrue(state);
        if (has_state != 0) {
            if (has_state < 0)
                PyErr_Clear();
            give_up(&out);
            goto done;
        }
    }
    int kind = -1;
    for (int i = 0; i < 5; i++)
        if (f[KIND] == kinds[i])
            kind = i;
    if (kind < 0) {
        give_up(&out);
        goto done;
    }

    Py_ssize_t whole = open_field(&out, 0x12);
    put_ids(&out, ctx);
    if (parent != Py_None) {
        put(&out, "\x22\x08", 2);
        put_id(&out, PyTuple_GET_ITEM(parent, 1), 8);
    }
    Py_ssize_t name_size;
    const char *name = text(&out, f[NAME], &name_size);
    if (name == NULL)
        goto done;
    put_text(&out, 0x2A, name, name_size);
    put_byte(&out, 0x30);
    put_byte(&out, (unsigned char)(kind + 1));
    uint64_t start, end;
    if (as_u64(&out, f[START], &start) < 0 || as_u64(&out, f[END], &end) < 0)
        goto done;
    put_byte(&out, 0x39);
    put_le64(&out, start);
    put_byte(&out, 0x41);
    put_le64(&out, end);
    put_attributes(&out, 0x4A, f[ATTRIBUTES]);
    put_count(&out, 0x50, span, s_dropped_attributes);
    put_count(&out, 0x60, span, s_dropped_events);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(f[LINKS]) && !stopped(&out); i++) {
        PyObject *link = Py_NewRef(PyList_GET_ITEM(f[LINKS], i)); /* reading it may run Python */
        put_link(&out, link);
        Py_DECREF(link);
    }
    put_count(&out, 0x70, span, s_dropped_links);
    put_status(&out, f[STATUS]);
    if (stopped(&out))
        goto done;
    int remote = 0;
    if (parent != Py_None && (remote = PyObject_IsTrue(PyTuple_GET_ITEM(parent, 2))) < 0) {
        out.failed = 1;
        goto done;
    }
    put(&out, "\x85\x01", 2);
    put(&out, remote ? IS_REMOTE : HAS_REMOTE, 4);
    close_field(&out, whole);

done:
    if (out.failed)
        result = NULL;
    else if (out.fallback)
        result = Py_NewRef(Py_None);
    else
        result = PyBytes_FromStringAndSize((const char *)out.data, out.len);
    if (out.data != out.stack)
        PyMem_Free(out.data);
    for (int i = 0; i < N; i++)
        Py_DECREF(f[i]);
    return result;
}

static PyObject *configure(PyObject *module, PyObject *args) {
    PyObject *kind_members, *code_members, *unset, *empty;
    if (!PyArg_ParseTuple(args, "O!O!OO", &PyTuple_Type, &kind_members, &PyTuple_Type,
                          &code_members, &unset, &empty))
        return NULL;
    if (PyTuple_GET_SIZE(kind_members) != 5 || PyTuple_GET_SIZE(code_members) != 3) {
        PyErr_SetString(PyExc_ValueError,
                        "configure() takes the 5 SpanKind and the 3 StatusCode members by value");
        return NULL;
    }
    for (int i = 0; i < 5; i++)
        Py_XSETREF(kinds[i], Py_NewRef(PyTuple_GET_ITEM(kind_members, i)));
    for (int i = 0; i < 3; i++)
        Py_XSETREF(codes[i], Py_NewRef(PyTuple_GET_ITEM(code_members, i)));
    Py_XSETREF(unset_status, Py_NewRef(unset));
    Py_XSETREF(empty_state, Py_NewRef(empty));
    configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"span", encode_span, METH_O,
     "span(span) -> bytes | None: the span as the ``spans`` field of a ``ScopeSpans``, "
     "the bytes tracer._span writes; None for a span this encoder leaves to Python."},
    {"configure", configure, METH_VARARGS,
     "configure(kinds, codes, unset_status, empty_state): the API's singletons, by value."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "flowdecision._otlp",
    "A span's OTLP protobuf bytes, in C (see tracer.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__otlp(void) {
    struct {
        PyObject **slot;
        const char *name;
    } interned[] = {
        {&s_context, "context"},
        {&s_parent, "parent"},
        {&s_name, "name"},
        {&s_kind, "kind"},
        {&s_start_time, "start_time"},
        {&s_end_time, "end_time"},
        {&s_attributes, "attributes"},
        {&s_dropped_attributes, "dropped_attributes"},
        {&s_events, "events"},
        {&s_dropped_events, "dropped_events"},
        {&s_links, "links"},
        {&s_dropped_links, "dropped_links"},
        {&s_status, "status"},
        {&s_status_code, "status_code"},
        {&s_description, "description"},
    };
    for (size_t i = 0; i < sizeof(interned) / sizeof(interned[0]); i++)
        if ((*interned[i].slot = PyUnicode_InternFromString(interned[i].name)) == NULL)
            return NULL;
    return PyModule_Create(&module_def);
}
