/* untrack(obj): take an object out of the cyclic garbage collector's sight
 * (PyObject_GC_UnTrack), for tierkv/_untracked.py. A module of its own, with the Python API
 * (the copy library beside it is loaded with ctypes and uses none): through ctypes the call
 * cost about 0.3 us, several per put; here it is a plain C function call. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *untrack(PyObject *module, PyObject *obj) {
    (void)module;
    /* only an object of a type with collector support has the header UnTrack reads */
    if (PyObject_IS_GC(obj)) {
        PyObject_GC_UnTrack(obj);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"untrack", untrack, METH_O, "Stop the cyclic garbage collector from walking obj."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_untrack", "PyObject_GC_UnTrack for tierkv._untracked.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__untrack(void) { return PyModule_Create(&module); }
