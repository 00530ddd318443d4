/* Python's door to the calls a decoding step makes many times a token (qkv.kernels.calls).
 *
 * ctypes converts each argument of a call through a Python object of its own: a call of twenty-four numbers costs
 * about 5 microseconds before any work, and a step of a small model makes a few hundred such calls. The same library
 * is therefore also a Python module, whose functions take the numbers as they are (addresses and sizes as ints,
 * None for a null pointer, floats) and call the C functions directly: the same functions, a fraction of a
 * microsecond a call. As ctypes does, each call lets other Python threads run while it computes (a server's
 * requests are read while the model decodes). Nothing here computes; the library keeps working through ctypes where
 * this door is not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

int qkv_linear(int format, int variant, const uint8_t *codes, const uint16_t *d, const uint16_t *m, int64_t rows,
               int64_t n, const float *x, int64_t batch, float *y);
void qkv_rms_norm(const float *x, const float *add, const float *gains, float eps, int64_t rows, int64_t n,
                  float *sum, float *out);
int qkv_gated(int variant, const float *gate_up, int64_t rows, int64_t d, int act, float *out);
int qkv_new_token_attention(int variant, const float *qkv, int64_t batch, int64_t tokens, int64_t heads,
                            int64_t kv_heads, int64_t dim, const float *cos, const float *sin, int64_t table,
                            int64_t token_table, int64_t rotary, int interleaved, float *keys, float *values,
                            int64_t room, int64_t row_stride, int64_t head_stride, int64_t length,
                            const int64_t *starts, int64_t window, float scale, float *scratch, float *out);
int qkv_linear_f32(int variant, const float *x, int64_t rows, int64_t n, const float *w, const float *bias, int64_t m,
                   float *y);

/* args[0..count) as int64 (None: 0), or -1 with Python's error set: a wrong count or a non-integer. */
static int numbers(PyObject *const *args, Py_ssize_t given, Py_ssize_t count, const char *name, int64_t *out)
{
    if (given != count) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, %zd given", name, count, given);
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (args[i] == Py_None) {
            out[i] = 0;
            continue;
        }
        out[i] = PyLong_AsLongLong(args[i]);
        if (out[i] == -1 && PyErr_Occurred())
            return -1;
    }
    return 0;
}

#define PTR(v) ((void *)(intptr_t)(v))

/* linear(format, variant, codes, d, m, rows, n, x, batch, y) -> status */
static PyObject *call_linear(PyObject *self, PyObject *const *args, Py_ssize_t given)
{
    int64_t a[10];
    (void)self;
    if (numbers(args, given, 10, "linear", a))
        return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = qkv_linear((int)a[0], (int)a[1], PTR(a[2]), PTR(a[3]), PTR(a[4]), a[5], a[6], PTR(a[7]), a[8], PTR(a[9]));
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

/* args as int64 but args[real], a float, in *value; -1 with Python's error set as numbers() sets it. */
static int numbers_and_real(PyObject *const *args, Py_ssize_t given, Py_ssize_t count, const char *name,
                            Py_ssize_t real, int64_t *out, double *value)
{
    PyObject *ints[32];
    if (given != count || count > 32) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, %zd given", name, count, given);
        return -1;
    }
    *value = PyFloat_AsDouble(args[real]);
    if (*value == -1.0 && PyErr_Occurred())
        return -1;
    for (Py_ssize_t i = 0; i < count; i++)
        ints[i] = i == real ? Py_None : args[i];
    return numbers(ints, count, count, name, out);
}

/* rms_norm(x, add, gains, eps, rows, n, sum, out) -> None; eps a float */
static PyObject *call_rms_norm(PyObject *self, PyObject *const *args, Py_ssize_t given)
{
    int64_t a[8];
    double eps;
    (void)self;
    if (numbers_and_real(args, given, 8, "rms_norm", 3, a, &eps))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    qkv_rms_norm(PTR(a[0]), PTR(a[1]), PTR(a[2]), (float)eps, a[4], a[5], PTR(a[6]), PTR(a[7]));
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* gated(variant, gate_up, rows, d, act, out) -> status */
static PyObject *call_gated(PyObject *self, PyObject *const *args, Py_ssize_t given)
{
    int64_t a[6];
    (void)self;
    if (numbers(args, given, 6, "gated", a))
        return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = qkv_gated((int)a[0], PTR(a[1]), a[2], a[3], (int)a[4], PTR(a[5]));
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

/* new_token_attention(the 24 arguments of qkv_new_token_attention, scale a float) -> status */
static PyObject *call_attention(PyObject *self, PyObject *const *args, Py_ssize_t given)
{
    int64_t a[24];
    double scale;
    (void)self;
    if (numbers_and_real(args, given, 24, "new_token_attention", 21, a, &scale))
        return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = qkv_new_token_attention((int)a[0], PTR(a[1]), a[2], a[3], a[4], a[5], a[6], PTR(a[7]), PTR(a[8]), a[9],
                                     a[10], a[11], (int)a[12], PTR(a[13]), PTR(a[14]), a[15], a[16], a[17], a[18],
                                     PTR(a[19]), a[20], (float)scale, PTR(a[22]), PTR(a[23]));
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

/* linear_f32(variant, x, rows, n, w, bias, m, y) -> status */
static PyObject *call_linear_f32(PyObject *self, PyObject *const *args, Py_ssize_t given)
{
    int64_t a[8];
    (void)self;
    if (numbers(args, given, 8, "linear_f32", a))
        return NULL;
    int status;
    Py_BEGIN_ALLOW_THREADS
    status = qkv_linear_f32((int)a[0], PTR(a[1]), a[2], a[3], PTR(a[4]), PTR(a[5]), a[6], PTR(a[7]));
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

static PyMethodDef methods[] = {
    {"linear", (PyCFunction)(void (*)(void))call_linear, METH_FASTCALL, "qkv_linear"},
    {"rms_norm", (PyCFunction)(void (*)(void))call_rms_norm, METH_FASTCALL, "qkv_rms_norm"},
    {"gated", (PyCFunction)(void (*)(void))call_gated, METH_FASTCALL, "qkv_gated"},
    {"new_token_attention", (PyCFunction)(void (*)(void))call_attention, METH_FASTCALL, "qkv_new_token_attention"},
    {"linear_f32", (PyCFunction)(void (*)(void))call_linear_f32, METH_FASTCALL, "qkv_linear_f32"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_q4", "qkv's kernels, called without ctypes", -1, methods,
                                    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__q4(void)
{
    return PyModule_Create(&module);
}
