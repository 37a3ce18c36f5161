/* flowdecision._fastreq: the common POST /v1/decisions body, decoded in C.
 *
 * Why: a decision's parse, its wire bytes and its canonical JSON were a fifth
 * of the interpreter's work for a POST (docs/BENCHMARKS.md, "Half the Python
 * per POST": a scratch build with them for free ran 1.2x the rate). This
 * decodes the shape almost every client sends -- a schedule_step decision
 * whose strings are plain ASCII, whose numbers are integers within i64, with
 * no repeated keys, unknown fields or non-default retry policy -- and returns
 * the DecisionRequest model.py would build, with the three texts it would
 * write and their digests (hashlib's SHA-256, as identity.py digests). For
 * anything else it returns None and model.py parses in Python, which also
 * names every error: this never decides that a body is invalid. Optional:
 * without a compiler the package installs without it. tests/test_fastreq.py
 * compares every field, text and digest with the Python parser's.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* Containers nested inside a step's input before handing over to Python (whose
 * limit, JSON_MAX_DEPTH = 127, counts the request's own three levels too). */
#define MAX_INPUT_DEPTH 32
/* Digits of an integer taken here: 18 always fit in i64 (as jsonwire._parse_int). */
#define MAX_DIGITS 18

/* ------------------------------------------------------------------- buffers */

typedef struct {
    char *data;
    Py_ssize_t len;
    Py_ssize_t cap;
} Buf;

static int buf_reserve(Buf *b, Py_ssize_t more) {
    if (b->len + more <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + more) cap *= 2;
    char *data = PyMem_Realloc(b->data, (size_t)cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = data;
    b->cap = cap;
    return 0;
}

static int buf_put(Buf *b, const char *s, Py_ssize_t n) {
    if (n == 0) return 0; /* b->data may be NULL: memcpy must not see it (UBSan) */
    if (buf_reserve(b, n) < 0) return -1;
    memcpy(b->data + b->len, s, (size_t)n);
    b->len += n;
    return 0;
}

#define PUT_LIT(b, lit) buf_put((b), (lit), (Py_ssize_t)(sizeof(lit) - 1))

static void buf_free(Buf *b) {
    PyMem_Free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

/* ------------------------------------------------------------------- scanner */

/* Every function below returns OK, NOT_HERE (not the common shape: Python's
 * turn, no exception set) or FAILED (an exception is set: out of memory). */
enum { OK = 0, NOT_HERE = 1, FAILED = -1 };

typedef struct {
    const char *p;
    const char *end;
} Cur;

static void skip_ws(Cur *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\t' || *c->p == '\n' || *c->p == '\r'))
        c->p++;
}

/* Whether the next token is ch (consumed if so). */
static int take(Cur *c, char ch) {
    skip_ws(c);
    if (c->p < c->end && *c->p == ch) {
        c->p++;
        return 1;
    }
    return 0;
}

/* A string of printable ASCII with nothing to escape (0x20..0x7E but '"' and
 * '\\'): its JSON text is its bytes in quotes, in json.loads and in serde_json
 * alike. Anything else (escapes, control characters, non-ASCII) is Python's. */
static int plain_string(Cur *c, const char **start, Py_ssize_t *len) {
    skip_ws(c);
    if (c->p >= c->end || *c->p != '"') return NOT_HERE;
    const char *s = ++c->p;
    while (c->p < c->end) {
        unsigned char ch = (unsigned char)*c->p;
        if (ch == '"') {
            *start = s;
            *len = c->p - s;
            c->p++;
            return OK;
        }
        if (ch < 0x20 || ch > 0x7E || ch == '\\') return NOT_HERE;
        c->p++;
    }
    return NOT_HERE;
}

static int same(const char *s, Py_ssize_t n, const char *lit) {
    return (Py_ssize_t)strlen(lit) == n && memcmp(s, lit, (size_t)n) == 0;
}

/* One member's key, then the colon; NOT_HERE for '}' (the caller checks). */
static int member_key(Cur *c, const char **key, Py_ssize_t *len) {
    if (plain_string(c, key, len) != OK) return NOT_HERE;
    return take(c, ':') ? OK : NOT_HERE;
}

/* After a member: 1 for another one (','), 0 for the end ('}'), NOT_HERE else. */
static int next_member(Cur *c, int *more) {
    if (take(c, ',')) {
        *more = 1;
        return OK;
    }
    if (take(c, '}')) {
        *more = 0;
        return OK;
    }
    return NOT_HERE;
}

/* -------------------------------------------------------- free-form values */

static int value(Cur *c, int depth, Buf *out, PyObject **result);

typedef struct {
    const char *key;
    Py_ssize_t key_len;
    Py_ssize_t text_at;
    Py_ssize_t text_len;
} Member;

static int member_order(const void *a, const void *b) {
    const Member *x = a, *y = b;
    Py_ssize_t n = x->key_len < y->key_len ? x->key_len : y->key_len;
    int cmp = memcmp(x->key, y->key, (size_t)n);
    if (cmp != 0) return cmp;
    return (x->key_len > y->key_len) - (x->key_len < y->key_len);
}

/* An object: a dict in the text's order (as json.loads builds it), its text
 * with keys sorted (as encode_json_text(sort_keys=True) writes it; ASCII keys
 * sort by byte as Python sorts them by code point). A repeated key is
 * Python's (jsonwire marks it). */
static int object(Cur *c, int depth, Buf *out, PyObject **result) {
    PyObject *dict = PyDict_New();
    if (dict == NULL) return FAILED;
    Buf texts = {0};
    Member *members = NULL;
    Py_ssize_t count = 0, cap = 0;
    int rc = NOT_HERE;
    if (take(c, '}')) {
        rc = PUT_LIT(out, "{}") < 0 ? FAILED : OK;
        goto done;
    }
    for (;;) {
        const char *key;
        Py_ssize_t key_len;
        if ((rc = member_key(c, &key, &key_len)) != OK) goto done;
        if (count == cap) {
            cap = cap ? cap * 2 : 8;
            Member *grown = PyMem_Realloc(members, (size_t)cap * sizeof(Member));
            if (grown == NULL) {
                PyErr_NoMemory();
                rc = FAILED;
                goto done;
            }
            members = grown;
        }
        Py_ssize_t at = texts.len;
        PyObject *item = NULL;
        if ((rc = value(c, depth, &texts, &item)) != OK) goto done;
        PyObject *name = PyUnicode_FromStringAndSize(key, key_len);
        if (name == NULL || PyDict_SetItem(dict, name, item) < 0) {
            Py_XDECREF(name);
            Py_DECREF(item);
            rc = FAILED;
            goto done;
        }
        Py_DECREF(name);
        Py_DECREF(item);
        members[count].key = key;
        members[count].key_len = key_len;
        members[count].text_at = at;
        members[count].text_len = texts.len - at;
        count++;
        int more;
        if ((rc = next_member(c, &more)) != OK) goto done;
        if (!more) break;
    }
    if (PyDict_GET_SIZE(dict) != count) {
        rc = NOT_HERE; /* a repeated key */
        goto done;
    }
    qsort(members, (size_t)count, sizeof(Member), member_order);
    if (PUT_LIT(out, "{") < 0) goto failed;
    for (Py_ssize_t i = 0; i < count; i++) {
        if ((i && PUT_LIT(out, ",") < 0) || PUT_LIT(out, "\"") < 0 ||
            buf_put(out, members[i].key, members[i].key_len) < 0 || PUT_LIT(out, "\":") < 0 ||
            buf_put(out, texts.data + members[i].text_at, members[i].text_len) < 0)
            goto failed;
    }
    if (PUT_LIT(out, "}") < 0) goto failed;
    rc = OK;
    goto done;
failed:
    rc = FAILED;
done:
    PyMem_Free(members);
    buf_free(&texts);
    if (rc == OK) {
        *result = dict;
    } else {
        Py_DECREF(dict);
    }
    return rc;
}

static int array(Cur *c, int depth, Buf *out, PyObject **result) {
    PyObject *list = PyList_New(0);
    if (list == NULL) return FAILED;
    int rc;
    if ((rc = PUT_LIT(out, "[") < 0 ? FAILED : OK) != OK) goto done;
    if (take(c, ']')) {
        rc = PUT_LIT(out, "]") < 0 ? FAILED : OK;
        goto done;
    }
    for (;;) {
        PyObject *item = NULL;
        if ((rc = value(c, depth, out, &item)) != OK) goto done;
        int appended = PyList_Append(list, item);
        Py_DECREF(item);
        if (appended < 0) {
            rc = FAILED;
            goto done;
        }
        if (take(c, ',')) {
            if (PUT_LIT(out, ",") < 0) {
                rc = FAILED;
                goto done;
            }
            continue;
        }
        rc = !take(c, ']') ? NOT_HERE : PUT_LIT(out, "]") < 0 ? FAILED : OK;
        goto done;
    }
done:
    if (rc == OK) {
        *result = list;
    } else {
        Py_DECREF(list);
    }
    return rc;
}

/* An integer of at most MAX_DIGITS digits, written as JSON writes it: no
 * leading zero, no "-0" (serde_json makes that a float). Fractions and
 * exponents (floats) are Python's: exactness and Ryu's form live there. */
static int integer(Cur *c, Buf *out, PyObject **result) {
    const char *s = c->p;
    int negative = 0;
    if (c->p < c->end && *c->p == '-') {
        negative = 1;
        c->p++;
    }
    const char *digits = c->p;
    long long n = 0;
    while (c->p < c->end && *c->p >= '0' && *c->p <= '9') {
        if (c->p - digits == MAX_DIGITS) return NOT_HERE;
        n = n * 10 + (*c->p - '0');
        c->p++;
    }
    Py_ssize_t count = c->p - digits;
    if (count == 0 || (count > 1 && *digits == '0') || (negative && n == 0)) return NOT_HERE;
    if (c->p < c->end && (*c->p == '.' || *c->p == 'e' || *c->p == 'E')) return NOT_HERE;
    *result = PyLong_FromLongLong(negative ? -n : n);
    if (*result == NULL) return FAILED;
    if (buf_put(out, s, c->p - s) < 0) {
        Py_CLEAR(*result);
        return FAILED;
    }
    return OK;
}

static int literal(Cur *c, const char *word, PyObject *constant, Buf *out, PyObject **result) {
    Py_ssize_t n = (Py_ssize_t)strlen(word);
    if (c->end - c->p < n || memcmp(c->p, word, (size_t)n) != 0) return NOT_HERE;
    c->p += n;
    if (buf_put(out, word, n) < 0) return FAILED;
    *result = Py_NewRef(constant);
    return OK;
}

/* Any JSON value of the common shape: its Python value (new reference) in
 * *result and its sorted-key text appended to out. */
static int value(Cur *c, int depth, Buf *out, PyObject **result) {
    skip_ws(c);
    if (c->p >= c->end) return NOT_HERE;
    switch (*c->p) {
    case '{':
        if (depth >= MAX_INPUT_DEPTH) return NOT_HERE;
        c->p++;
        return object(c, depth + 1, out, result);
    case '[':
        if (depth >= MAX_INPUT_DEPTH) return NOT_HERE;
        c->p++;
        return array(c, depth + 1, out, result);
    case '"': {
        const char *s;
        Py_ssize_t n;
        if (plain_string(c, &s, &n) != OK) return NOT_HERE;
        *result = PyUnicode_FromStringAndSize(s, n);
        if (*result == NULL) return FAILED;
        if (PUT_LIT(out, "\"") < 0 || buf_put(out, s, n) < 0 || PUT_LIT(out, "\"") < 0) {
            Py_CLEAR(*result);
            return FAILED;
        }
        return OK;
    }
    case 't':
        return literal(c, "true", Py_True, out, result);
    case 'f':
        return literal(c, "false", Py_False, out, result);
    case 'n':
        return literal(c, "null", Py_None, out, result);
    default:
        return integer(c, out, result);
    }
}

/* ------------------------------------------------------------ the request */

typedef struct {
    const char *s;
    Py_ssize_t n;
} Text;

typedef struct {
    Text decision_id, run_id, branch, cause, step_id, step_name;
    PyObject *input;
    Buf input_text;
} Request;

/* {"max_attempts":3,"delay_ms":0}, either order: the default policy, whose texts
 * are known. Any other policy is Python's (its checks and texts are there). */
static int retry(Cur *c) {
    if (!take(c, '{')) return NOT_HERE;
    int attempts = 0, delay = 0, more = 1;
    while (more) {
        const char *key;
        Py_ssize_t len;
        if (member_key(c, &key, &len) != OK) return NOT_HERE;
        skip_ws(c);
        int *seen;
        char want;
        if (same(key, len, "max_attempts")) {
            seen = &attempts;
            want = '3';
        } else if (same(key, len, "delay_ms")) {
            seen = &delay;
            want = '0';
        } else {
            return NOT_HERE;
        }
        if (*seen || c->p >= c->end || *c->p != want) return NOT_HERE;
        c->p++;
        if (c->p < c->end && ((*c->p >= '0' && *c->p <= '9') || *c->p == '.' || *c->p == 'e' ||
                              *c->p == 'E'))
            return NOT_HERE;
        *seen = 1;
        if (next_member(c, &more) != OK) return NOT_HERE;
    }
    return attempts && delay ? OK : NOT_HERE;
}

static int step(Cur *c, Request *r) {
    if (!take(c, '{')) return NOT_HERE;
    int have_id = 0, have_name = 0, have_retry = 0, more = 1, rc;
    while (more) {
        const char *key;
        Py_ssize_t len;
        if (member_key(c, &key, &len) != OK) return NOT_HERE;
        if (same(key, len, "step_id") && !have_id) {
            if (plain_string(c, &r->step_id.s, &r->step_id.n) != OK) return NOT_HERE;
            have_id = 1;
        } else if (same(key, len, "step_name") && !have_name) {
            if (plain_string(c, &r->step_name.s, &r->step_name.n) != OK) return NOT_HERE;
            have_name = 1;
        } else if (same(key, len, "input") && r->input == NULL) {
            if ((rc = value(c, 0, &r->input_text, &r->input)) != OK) return rc;
        } else if (same(key, len, "retry") && !have_retry) {
            if (retry(c) != OK) return NOT_HERE;
            have_retry = 1;
        } else {
            return NOT_HERE;
        }
        if (next_member(c, &more) != OK) return NOT_HERE;
    }
    return have_id && have_name && r->input != NULL ? OK : NOT_HERE;
}

static int decision(Cur *c, Request *r) {
    if (!take(c, '{')) return NOT_HERE;
    int have_type = 0, have_step = 0, more = 1, rc;
    while (more) {
        const char *key;
        Py_ssize_t len;
        if (member_key(c, &key, &len) != OK) return NOT_HERE;
        if (same(key, len, "type") && !have_type) {
            const char *s;
            Py_ssize_t n;
            if (plain_string(c, &s, &n) != OK || !same(s, n, "schedule_step")) return NOT_HERE;
            have_type = 1;
        } else if (same(key, len, "step") && !have_step) {
            if ((rc = step(c, r)) != OK) return rc;
            have_step = 1;
        } else {
            return NOT_HERE;
        }
        if (next_member(c, &more) != OK) return NOT_HERE;
    }
    return have_type && have_step ? OK : NOT_HERE;
}

static int request(Cur *c, Request *r) {
    if (!take(c, '{')) return NOT_HERE;
    int have_decision = 0, more = 1, rc;
    while (more) {
        const char *key;
        Py_ssize_t len;
        if (member_key(c, &key, &len) != OK) return NOT_HERE;
        Text *field = NULL;
        if (same(key, len, "decision_id"))
            field = &r->decision_id;
        else if (same(key, len, "run_id"))
            field = &r->run_id;
        else if (same(key, len, "authority_branch_id"))
            field = &r->branch;
        else if (same(key, len, "causation_event_id"))
            field = &r->cause;
        if (field != NULL) {
            if (field->s != NULL || plain_string(c, &field->s, &field->n) != OK) return NOT_HERE;
        } else if (same(key, len, "decision") && !have_decision) {
            if ((rc = decision(c, r)) != OK) return rc;
            have_decision = 1;
        } else {
            return NOT_HERE;
        }
        if (next_member(c, &more) != OK) return NOT_HERE;
    }
    skip_ws(c);
    if (c->p != c->end) return NOT_HERE; /* trailing characters: Python's error */
    return have_decision && r->decision_id.s && r->run_id.s && r->branch.s && r->cause.s
               ? OK
               : NOT_HERE;
}

/* ------------------------------------------------------------------ texts */

static int put_quoted(Buf *b, Text t) {
    return PUT_LIT(b, "\"") < 0 || buf_put(b, t.s, t.n) < 0 || PUT_LIT(b, "\"") < 0 ? -1 : 0;
}

/* DecisionRequest.decision_json(): ScheduleStep._wire_text(). */
static int decision_text(Buf *b, const Request *r) {
    return PUT_LIT(b, "{\"type\":\"schedule_step\",\"step\":{\"step_id\":") < 0 ||
                   put_quoted(b, r->step_id) < 0 || PUT_LIT(b, ",\"step_name\":") < 0 ||
                   put_quoted(b, r->step_name) < 0 || PUT_LIT(b, ",\"input\":") < 0 ||
                   buf_put(b, r->input_text.data, r->input_text.len) < 0 ||
                   PUT_LIT(b, ",\"retry\":{\"max_attempts\":3,\"delay_ms\":0}}}") < 0
               ? -1
               : 0;
}

/* DecisionRequest.to_json(): the wire bytes, fields in struct order. */
static int wire_text(Buf *b, const Request *r, const Buf *decision) {
    return PUT_LIT(b, "{\"decision_id\":") < 0 || put_quoted(b, r->decision_id) < 0 ||
                   PUT_LIT(b, ",\"run_id\":") < 0 || put_quoted(b, r->run_id) < 0 ||
                   PUT_LIT(b, ",\"authority_branch_id\":") < 0 || put_quoted(b, r->branch) < 0 ||
                   PUT_LIT(b, ",\"causation_event_id\":") < 0 || put_quoted(b, r->cause) < 0 ||
                   PUT_LIT(b, ",\"decision\":") < 0 ||
                   buf_put(b, decision->data, decision->len) < 0 || PUT_LIT(b, "}") < 0
               ? -1
               : 0;
}

/* DecisionRequest.canonical_json(): every key sorted, struct fields too. */
static int canonical_text(Buf *b, const Request *r) {
    return PUT_LIT(b, "{\"authority_branch_id\":") < 0 || put_quoted(b, r->branch) < 0 ||
                   PUT_LIT(b, ",\"causation_event_id\":") < 0 || put_quoted(b, r->cause) < 0 ||
                   PUT_LIT(b, ",\"decision\":{\"step\":{\"input\":") < 0 ||
                   buf_put(b, r->input_text.data, r->input_text.len) < 0 ||
                   PUT_LIT(b, ",\"retry\":{\"delay_ms\":0,\"max_attempts\":3},\"step_id\":") < 0 ||
                   put_quoted(b, r->step_id) < 0 || PUT_LIT(b, ",\"step_name\":") < 0 ||
                   put_quoted(b, r->step_name) < 0 ||
                   PUT_LIT(b, "},\"type\":\"schedule_step\"},\"decision_id\":") < 0 ||
                   put_quoted(b, r->decision_id) < 0 || PUT_LIT(b, ",\"run_id\":") < 0 ||
                   put_quoted(b, r->run_id) < 0 || PUT_LIT(b, "}") < 0
               ? -1
               : 0;
}

static PyObject *text_str(Text t) { return PyUnicode_FromStringAndSize(t.s, t.n); }

/* ----------------------------------------------------------------- objects */

/* Set by configure_types(): the classes model.py builds a request of (frozen
 * dataclasses with slots), the member descriptor of each slot, in the order
 * build() takes values, and the default retry policy. A class whose slots are
 * not exactly these is refused there, so none is ever left unset. */
typedef struct {
    const char *const *names;
    int count;
    PyTypeObject *type;
    PyObject *slots[10];
} Shape;

static const char *const step_names[] = {"step_id", "step_name", "input", "retry",
                                         "_input_text"};
static const char *const schedule_names[] = {"step"};
static const char *const request_names[] = {
    "decision_id", "run_id", "authority_branch_id", "causation_event_id", "decision",
    "_json", "_decision_json", "_hash", "_canonical", "_digests"};
static Shape step_shape = {step_names, 5};
static Shape schedule_shape = {schedule_names, 1};
static Shape request_shape = {request_names, 10};
static PyObject *default_retry;

static int learn(Shape *shape, PyObject *type) {
    if (!PyType_Check(type)) {
        PyErr_SetString(PyExc_TypeError, "configure_types() takes classes");
        return -1;
    }
    PyObject *slots = PyObject_GetAttrString(type, "__slots__");
    if (slots == NULL) return -1;
    int same_slots = PyTuple_Check(slots) && PyTuple_GET_SIZE(slots) == shape->count;
    for (int i = 0; same_slots && i < shape->count; i++) {
        PyObject *name = PyTuple_GET_ITEM(slots, i);
        same_slots = PyUnicode_Check(name) &&
                     PyUnicode_CompareWithASCIIString(name, shape->names[i]) == 0;
    }
    Py_DECREF(slots);
    if (!same_slots) {
        PyErr_Format(PyExc_TypeError, "%s's slots are not the ones _fastreq.c fills",
                     ((PyTypeObject *)type)->tp_name);
        return -1;
    }
    for (int i = 0; i < shape->count; i++) {
        PyObject *slot = PyDict_GetItemString(((PyTypeObject *)type)->tp_dict, shape->names[i]);
        if (slot == NULL || !PyObject_TypeCheck(slot, &PyMemberDescr_Type)) {
            PyErr_Format(PyExc_TypeError, "%s.%s is not a slot",
                         ((PyTypeObject *)type)->tp_name, shape->names[i]);
            return -1;
        }
        Py_XSETREF(shape->slots[i], Py_NewRef(slot));
    }
    Py_XSETREF(shape->type, (PyTypeObject *)Py_NewRef(type));
    return 0;
}

static PyObject *configure_types(PyObject *module, PyObject *args) {
    PyObject *request, *schedule, *step, *retry;
    if (!PyArg_ParseTuple(args, "OOOO:configure_types", &request, &schedule, &step, &retry) ||
        learn(&request_shape, request) < 0 || learn(&schedule_shape, schedule) < 0 ||
        learn(&step_shape, step) < 0)
        return NULL;
    Py_XSETREF(default_retry, Py_NewRef(retry));
    Py_RETURN_NONE;
}

/* A new instance of shape's class with values (borrowed, none NULL) in its
 * slots, as object.__new__ and object.__setattr__ make one; NULL (an exception
 * set) if that fails. */
static PyObject *build(Shape *shape, PyObject *const *values) {
    PyObject *obj = shape->type->tp_alloc(shape->type, 0);
    for (int i = 0; obj != NULL && i < shape->count; i++) {
        PyObject *slot = shape->slots[i];
        if (Py_TYPE(slot)->tp_descr_set(slot, obj, values[i]) < 0) Py_CLEAR(obj);
    }
    return obj;
}

/* ----------------------------------------------------------------- digests */

/* Set by configure_digests(): hashlib.sha256, and each receipt domain's UTF-8 bytes
 * followed by NUL (identity.digest_bytes digests domain || 0x00 || data). */
static PyObject *sha256_new;
static PyObject *identity_prefix, *evidence_prefix, *result_prefix;
static PyObject *s_hexdigest, *s_tag;

/* hex(SHA-256(prefix || data)), "sha256:"-tagged when prefix is given. */
static PyObject *hex_digest(PyObject *prefix, const char *data, Py_ssize_t n) {
    Py_ssize_t head = prefix == NULL ? 0 : PyBytes_GET_SIZE(prefix);
    PyObject *input = PyBytes_FromStringAndSize(NULL, head + n);
    if (input == NULL) return NULL;
    if (head) memcpy(PyBytes_AS_STRING(input), PyBytes_AS_STRING(prefix), (size_t)head);
    memcpy(PyBytes_AS_STRING(input) + head, data, (size_t)n);
    PyObject *hasher = PyObject_CallOneArg(sha256_new, input);
    Py_DECREF(input);
    if (hasher == NULL) return NULL;
    PyObject *hex = PyObject_CallMethodNoArgs(hasher, s_hexdigest);
    Py_DECREF(hasher);
    if (hex == NULL || prefix == NULL) return hex;
    PyObject *tagged = PyUnicode_Concat(s_tag, hex);
    Py_DECREF(hex);
    return tagged;
}

static PyObject *domain_prefix(PyObject *domain) {
    if (!PyUnicode_Check(domain)) {
        PyErr_SetString(PyExc_TypeError, "a receipt domain must be a str");
        return NULL;
    }
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(domain, &n);
    if (utf8 == NULL) return NULL;
    PyObject *prefix = PyBytes_FromStringAndSize(NULL, n + 1);
    if (prefix == NULL) return NULL;
    memcpy(PyBytes_AS_STRING(prefix), utf8, (size_t)n);
    PyBytes_AS_STRING(prefix)[n] = '\0';
    return prefix;
}

static PyObject *configure_digests(PyObject *module, PyObject *args) {
    PyObject *sha256, *identity, *evidence, *result;
    if (!PyArg_ParseTuple(args, "OUUU:configure_digests", &sha256, &identity, &evidence, &result))
        return NULL;
    PyObject *prefixes[3] = {NULL, NULL, NULL};
    if ((prefixes[0] = domain_prefix(identity)) == NULL ||
        (prefixes[1] = domain_prefix(evidence)) == NULL ||
        (prefixes[2] = domain_prefix(result)) == NULL) {
        for (int i = 0; i < 3; i++) Py_XDECREF(prefixes[i]);
        return NULL;
    }
    Py_XSETREF(identity_prefix, prefixes[0]);
    Py_XSETREF(evidence_prefix, prefixes[1]);
    Py_XSETREF(result_prefix, prefixes[2]);
    Py_XSETREF(sha256_new, Py_NewRef(sha256));
    Py_RETURN_NONE;
}

/* Each value decode() makes, in the order it makes them: the first that fails
 * ends it (with that exception set), so no later step calls into Python with
 * an exception pending -- which would turn, say, a MemoryError into a
 * SystemError. Slots are NULL until made; all are released at the end. */
enum {
    STEP_ID, STEP_NAME, INPUT, RETRY, INPUT_TEXT, /* the DecisionStep, in slot order */
    STEP,                                         /* the ScheduleStep's one slot */
    DECISION_ID, RUN_ID, BRANCH, CAUSE, DECISION, WIRE, DECISION_TEXT, REQUEST_HASH,
    CANONICAL, DIGESTS, /* the DecisionRequest, in slot order */
    IDENTITY_DIGEST, EVIDENCE_DIGEST, RESULT_DIGEST, /* DIGESTS' three items */
    VALUES
};
_Static_assert(INPUT_TEXT - STEP_ID + 1 == sizeof step_names / sizeof *step_names, "slots");
_Static_assert(DIGESTS - DECISION_ID + 1 == sizeof request_names / sizeof *request_names, "slots");

/* The three receipt digests (None until configure_digests() ran: then they are
 * computed in Python, as the request hash is). */
static int digest(PyObject **v, const Request *r, const Buf *decision, const Buf *wire,
                  const Buf *canonical) {
    if (sha256_new == NULL) {
        v[REQUEST_HASH] = Py_NewRef(Py_None);
        v[DIGESTS] = Py_NewRef(Py_None);
        return 0;
    }
    if ((v[REQUEST_HASH] = hex_digest(NULL, wire->data, wire->len)) == NULL ||
        (v[IDENTITY_DIGEST] = hex_digest(identity_prefix, canonical->data, canonical->len)) ==
            NULL ||
        (v[EVIDENCE_DIGEST] = hex_digest(evidence_prefix, r->cause.s, r->cause.n)) == NULL ||
        (v[RESULT_DIGEST] = hex_digest(result_prefix, decision->data, decision->len)) == NULL)
        return -1;
    v[DIGESTS] = PyTuple_Pack(3, v[IDENTITY_DIGEST], v[EVIDENCE_DIGEST], v[RESULT_DIGEST]);
    return v[DIGESTS] == NULL ? -1 : 0;
}

static PyObject *decode(PyObject *module, PyObject *body) {
    if (!PyBytes_CheckExact(body) || request_shape.type == NULL) Py_RETURN_NONE;
    Cur c = {PyBytes_AS_STRING(body), PyBytes_AS_STRING(body) + PyBytes_GET_SIZE(body)};
    Request r;
    memset(&r, 0, sizeof r);
    Buf decision_buf = {0}, wire_buf = {0}, canonical_buf = {0};
    PyObject *v[VALUES] = {NULL};
    PyObject *result = NULL;
    int rc = request(&c, &r);
    if (rc == FAILED) goto done;
    if (rc == NOT_HERE) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (decision_text(&decision_buf, &r) < 0 ||
        wire_text(&wire_buf, &r, &decision_buf) < 0 || canonical_text(&canonical_buf, &r) < 0 ||
        /* model.request_hash and identity.decision_receipt's three digests */
        digest(v, &r, &decision_buf, &wire_buf, &canonical_buf) < 0)
        goto done;
    v[INPUT] = Py_NewRef(r.input);
    v[RETRY] = Py_NewRef(default_retry);
    if ((v[STEP_ID] = text_str(r.step_id)) == NULL ||
        (v[STEP_NAME] = text_str(r.step_name)) == NULL ||
        (v[INPUT_TEXT] = PyUnicode_FromStringAndSize(r.input_text.data, r.input_text.len)) ==
            NULL ||
        (v[STEP] = build(&step_shape, &v[STEP_ID])) == NULL ||
        (v[DECISION] = build(&schedule_shape, &v[STEP])) == NULL ||
        (v[DECISION_ID] = text_str(r.decision_id)) == NULL ||
        (v[RUN_ID] = text_str(r.run_id)) == NULL || (v[BRANCH] = text_str(r.branch)) == NULL ||
        (v[CAUSE] = text_str(r.cause)) == NULL ||
        (v[WIRE] = PyBytes_FromStringAndSize(wire_buf.data, wire_buf.len)) == NULL ||
        (v[DECISION_TEXT] = PyBytes_FromStringAndSize(decision_buf.data, decision_buf.len)) ==
            NULL ||
        (v[CANONICAL] = PyBytes_FromStringAndSize(canonical_buf.data, canonical_buf.len)) == NULL)
        goto done;
    result = build(&request_shape, &v[DECISION_ID]);
done:
    for (int i = 0; i < VALUES; i++) Py_XDECREF(v[i]);
    Py_XDECREF(r.input);
    buf_free(&r.input_text);
    buf_free(&decision_buf);
    buf_free(&wire_buf);
    buf_free(&canonical_buf);
    return result;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_O,
     "decode(body) -> DecisionRequest | None\n\n"
     "A common decision request, with its wire, decision and canonical JSON, its\n"
     "request hash and its receipt digests; None for any body model.py must parse\n"
     "itself (and until configure_types() ran)."},
    {"configure_types", configure_types, METH_VARARGS,
     "configure_types(DecisionRequest, ScheduleStep, DecisionStep, default_retry)\n\n"
     "The classes decode() builds (their slots checked) and the default retry policy."},
    {"configure_digests", configure_digests, METH_VARARGS,
     "configure_digests(sha256, identity_domain, evidence_domain, result_domain)\n\n"
     "The hash constructor and the receipt domains decode() digests with."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "flowdecision._fastreq",
    "The common decision request body, decoded in C (see model.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__fastreq(void) {
    s_hexdigest = PyUnicode_InternFromString("hexdigest");
    s_tag = PyUnicode_InternFromString("sha256:");
    if (s_hexdigest == NULL || s_tag == NULL) return NULL;
    return PyModule_Create(&module);
}
