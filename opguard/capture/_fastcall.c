/* The function mode's common call in C (docs/capture.md §3.11).
 *
 * CaptureMode.__torch_function__ (mode.py) hands every call to handle() when this module is
 * built. handle() does what CaptureMode.handle() does, step for step, for the calls that need
 * nothing but the common steps: a function the mode planned (mode.plans: a builtin torch
 * function, or a collapsed wrapper, that is recorded, neither special nor re-entered), called with
 * plain tensors and simple scalars, while the whole run is selected (no filter, no dump policy,
 * every step) and nothing else is in flight. Every other call goes to handle() in Python, decided
 * before anything is recorded. The Python steps it calls are the same objects CaptureMode.handle()
 * calls (the call site, the record, the tensor entries, the stand-in that calls the function), so
 * the record is the same; what is gone is the handler's own Python.
 *
 * Built with the limited API (abi3), like _hostkernel.c; optional: without it mode.py runs the
 * Python handler alone.
 */
#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030A0000
#include <Python.h>

#include <math.h>

#define SLOTS 16 /* positional arguments named without formatting (arg0 .. arg15); more: the Python path */

/* mode.py and records.py (their functions are read at each use, as the Python handler reads them:
 * a replaced one is honoured), Tensor, Parameter, and the argument types arg_entry() files */
static PyObject *g_mode_mod, *g_records_mod, *g_Tensor, *g_Parameter, *g_simple;
/* session.py (its _DTYPE_NAMES and CACHE_ENTRIES are read at each use), hostkernel.py (CODES, read
 * at each use), Session._entry_fast as defined in session.py (the C entry stands in for it only while
 * it is that function), _Summary, _Ref, torch.device("cpu"), torch.strided */
static PyObject *g_session_mod, *g_hostkernel_mod, *g_entry_fast, *g_Summary, *g_Ref, *g_cpu, *g_strided;
static PyObject *arg_slots[SLOTS];
static int configured;

/* interned names */
static PyObject *n_session, *n_busy, *n_quiet, *n_inflight, *n_plans, *n_cap_reached, *n_closed, *n_all_steps,
    *n_select_all, *n_policy, *n_enabled, *n_host_digest, *n_uninit, *n_wrappers, *n_watching, *n_modules,
    *n_contexts, *n_sites, *n_call_site, *n_begin, *n_rec, *n_seq, *n_parents, *n_entry_fast, *n_entry, *n_fresh,
    *n_failed, *n_recording, *n_maybe_flush, *n_function, *n_where, *n_inputs,
    *n_outputs, *n_args, *n_seeded, *n_error, *n_out, *n_self, *n_slot, *n_type, *n_value, *n_float, *n_int,
    *n_bool, *n_none, *n_ids, *n_slash, *n_handle, *n_name, *n_passes, *n_standin, *n_unselected, *n_tensors_in,
    *n_arg_entry, *n_dtype_name, *n_hex, *n_dtype, *n_shape, *n_device, *n_cpu, *n_digest, *n_stats, *n_values,
    *n_seen_attr, *n_ref, *n_storage_offset, *n_element_size, *n_dead_cb, *n_key, *n_tid, *n_region, *n_dead, *n_at, *n_shared,
    *n_host_entry, *n_base, *n_version, *n_data_ptr, *n_is_cpu, *n_layout, *n_is_neg, *n_is_contiguous, *n_numel, *n_cache,
    *n_new, *n_n, *n_cache_entries, *n_dtype_names, *n_codes;
static PyObject *g_zero;

static int intern(PyObject **p, const char *s) {
    *p = PyUnicode_InternFromString(s);
    return *p == NULL ? -1 : 0;
}

/* An entry point called with its 6 arguments, after the configure calls it needs (mask: 1
 * configure_entry(), 2 configure()); else -1 with the error set. */
static int ready(Py_ssize_t n, const char *usage, int mask) {
    if (n != 6) {
        PyErr_Format(PyExc_TypeError, "opguard.capture._fastcall.%s takes 6 arguments, got %zd", usage, n);
        return -1;
    }
    if ((configured & mask) != mask) {
        PyErr_Format(PyExc_RuntimeError, "opguard.capture._fastcall.%s: called before configure_entry()%s", usage,
                     mask & 2 ? " and configure()" : "");
        return -1;
    }
    return 0;
}

/* mod.name(*args) */
static PyObject *call_global(PyObject *mod, PyObject *name, PyObject *a, PyObject *b, PyObject *c, PyObject *d,
                             PyObject *e, PyObject *f) {
    PyObject *fn = PyObject_GetAttr(mod, name);
    if (fn == NULL) return NULL;
    PyObject *r = PyObject_CallFunctionObjArgs(fn, a, b, c, d, e, f, NULL);
    Py_DECREF(fn);
    return r;
}

/* 1: true, 0: false, -1: error */
static int attr_true(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) return -1;
    int r = PyObject_IsTrue(v);
    Py_DECREF(v);
    return r;
}

static int attr_is_none(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) return -1;
    int r = v == Py_None;
    Py_DECREF(v);
    return r;
}

/* An exception leaving mode.handle(): its traceback without handle's own entry (the head, the outermost
 * frame it has passed so far), so that a traceback through an op shows one frame of capture's
 * (__torch_function__, which calls this) as it does on the C path (docs/capture.md §11). */
static void drop_handle_frame(void) {
    PyObject *type = NULL, *value = NULL, *tb = NULL;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) {
        PyObject *frame = PyObject_GetAttrString(tb, "tb_frame");
        PyObject *code = frame ? PyObject_GetAttrString(frame, "f_code") : NULL;
        PyObject *name = code ? PyObject_GetAttrString(code, "co_name") : NULL;
        PyObject *next = name ? PyObject_GetAttrString(tb, "tb_next") : NULL;
        if (next != NULL && PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "handle") == 0 &&
            PyException_SetTraceback(value, next) == 0) {
            Py_DECREF(tb);
            tb = next == Py_None ? NULL : next;
            Py_XINCREF(tb);
        }
        Py_XDECREF(next);
        Py_XDECREF(name);
        Py_XDECREF(code);
        Py_XDECREF(frame);
        PyErr_Clear(); /* a failed attribute read leaves the traceback as it was */
    }
    PyErr_Restore(type, value, tb);
}

/* The Python handler: mode.handle(caller, func, types, args, kwargs). */
static PyObject *slow(PyObject *mode, PyObject *caller, PyObject *func, PyObject *types, PyObject *args,
                      PyObject *kwargs) {
    PyObject *h = PyObject_GetAttr(mode, n_handle);
    if (h == NULL) return NULL;
    PyObject *r = PyObject_CallFunctionObjArgs(h, caller, func, types, args, kwargs, NULL);
    Py_DECREF(h);
    if (r == NULL) drop_handle_frame();
    return r;
}

/* A scalar entry {"slot", "type", "value"} exactly as mode._split makes it. */
static PyObject *scalar_entry(PyObject *slot, PyObject *kind, PyObject *value) {
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    if (PyDict_SetItem(d, n_slot, slot) < 0 || PyDict_SetItem(d, n_type, kind) < 0 ||
        PyDict_SetItem(d, n_value, value) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

/* How mode._split files one argument: 1 tensor, 2 a scalar entry made here, 3 arg_entry(), 0 the
 * Python path (a tensor subclass, a list, a slice, a mapping, any other object). */
static int classify(PyObject *v, PyObject **kind) {
    PyTypeObject *t = Py_TYPE(v);
    *kind = NULL;
    if ((PyObject *)t == g_Tensor || (PyObject *)t == g_Parameter) return 1;
    if (t == &PyFloat_Type) {
        if (isfinite(PyFloat_AsDouble(v))) {
            *kind = n_float;
            return 2;
        }
        return 3;
    }
    if (t == &PyLong_Type) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (x == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
        if (!overflow && x > -(1LL << 53) && x < (1LL << 53)) {
            *kind = n_int;
            return 2;
        }
        return 3;
    }
    if (t == &PyBool_Type) {
        *kind = n_bool;
        return 2;
    }
    if (v == Py_None) {
        *kind = n_none;
        return 2;
    }
    if (t == &PyTuple_Type || t == &PyList_Type) { /* without tensors or slices: one arg_entry() */
        PyObject *seq = PySequence_Fast(v, "a list or tuple");
        if (seq == NULL) {
            PyErr_Clear();
            return 0;
        }
        Py_ssize_t n = PySequence_Size(seq);
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *x = PySequence_GetItem(seq, i);
            if (x == NULL) {
                PyErr_Clear();
                Py_DECREF(seq);
                return 0;
            }
            int bad = PySlice_Check(x) || PyObject_IsInstance(x, g_Tensor) != 0;
            Py_DECREF(x);
            if (bad) {
                PyErr_Clear();
                Py_DECREF(seq);
                return 0;
            }
        }
        Py_DECREF(seq);
        return 3;
    }
    int simple = PySequence_Contains(g_simple, (PyObject *)t);
    if (simple < 0) {
        PyErr_Clear();
        return 0;
    }
    return simple ? 3 : 0;
}

/* Tensor entries into ins [(slot, t)], argument entries into xs, in argument order (mode.split_args). */
static int split(PyObject *slot, PyObject *v, PyObject *ins, PyObject *xs) {
    PyObject *kind;
    int c = classify(v, &kind);
    PyObject *item = NULL;
    if (c == 1) {
        item = PyTuple_Pack(2, slot, v);
        if (item == NULL || PyList_Append(ins, item) < 0) goto fail;
    } else if (c == 2) {
        item = scalar_entry(slot, kind, v);
        if (item == NULL || PyList_Append(xs, item) < 0) goto fail;
    } else {
        item = call_global(g_records_mod, n_arg_entry, slot, v, NULL, NULL, NULL, NULL);
        if (item == NULL || PyList_Append(xs, item) < 0) goto fail;
    }
    Py_DECREF(item);
    return 0;
fail:
    Py_XDECREF(item);
    return -1;
}

/* session.failed("recording", <the exception being handled>, call); the exception is cleared.
 * Returns -1 when it is not an Exception (KeyboardInterrupt and the like propagate, as in Python). */
static int contain(PyObject *s, PyObject *call) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    PyObject *r = NULL;
    if (value != NULL) {
        PyObject *f = PyObject_GetAttr(s, n_failed);
        if (f != NULL) {
            r = PyObject_CallFunctionObjArgs(f, n_recording, value, call ? call : Py_None, NULL);
            Py_DECREF(f);
        }
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (r == NULL) return -1; /* failed() itself failed: that error propagates */
    Py_DECREF(r);
    return 0;
}


/* ---- the tensor entry (Session._entry_fast) ------------------------------------------------------
 * entry_c() is Session._entry_fast for its two common cases: the same tensor object used again
 * unchanged (the same-object record, _seen), and a plain contiguous CPU tensor summarised by the
 * native kernel's entry() (the cache, _remember, _known). It returns NotImplemented, having changed
 * nothing, where _entry_fast in Python must decide (a non-contiguous tensor, a write through an
 * alias, memory shared outside torch, a kernel row that is not finished, a pending summary). */

static int attr_eq(PyObject *o, PyObject *name, PyObject *value) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v == NULL) return -1;
    int r = PyObject_RichCompareBool(v, value, Py_EQ);
    Py_DECREF(v);
    return r;
}

static PyObject *method0(PyObject *o, PyObject *name) { return PyObject_CallMethodObjArgs(o, name, NULL); }

/* session.CACHE_ENTRIES now (-1: error) */
static Py_ssize_t cache_entries(void) {
    PyObject *v = PyObject_GetAttr(g_session_mod, n_cache_entries);
    if (v == NULL) return -1;
    Py_ssize_t n = PyLong_AsSsize_t(v);
    Py_DECREF(v);
    return n;
}

/* module.name[key], borrowed-free: a new reference, NULL with no error when absent */
static PyObject *module_dict_get(PyObject *mod, PyObject *name, PyObject *key) {
    PyObject *d = PyObject_GetAttr(mod, name);
    if (d == NULL) return NULL;
    PyObject *v = PyDict_Check(d) ? PyDict_GetItemWithError(d, key) : NULL;
    Py_XINCREF(v);
    Py_DECREF(d);
    return v;
}

/* _known(): the entry of a summary known now, and t's same-object record for its next use */
static PyObject *known(PyObject *s, PyObject *slot, PyObject *t, PyObject *sm, PyObject *dtype, PyObject *size,
                       PyObject *version, PyObject *ptr, int output) {
    PyObject *dn = NULL, *shape = NULL, *e = NULL, *hex = NULL, *seen = NULL, *ref = NULL, *rec = NULL, *id = NULL;
    PyObject *result = NULL;
    dn = module_dict_get(g_session_mod, n_dtype_names, dtype);
    if (dn == NULL) {
        if (PyErr_Occurred()) goto fail;
        dn = call_global(g_records_mod, n_dtype_name, dtype, NULL, NULL, NULL, NULL, NULL);
        if (dn == NULL) goto fail;
    }
    shape = PySequence_List(size);
    hex = shape ? PyObject_GetAttr(sm, n_hex) : NULL;
    e = hex ? PyDict_New() : NULL;
    if (e == NULL || PyDict_SetItem(e, n_slot, slot) < 0 || PyDict_SetItem(e, n_dtype, dn) < 0 ||
        PyDict_SetItem(e, n_shape, shape) < 0 || PyDict_SetItem(e, n_device, n_cpu) < 0 ||
        PyDict_SetItem(e, n_digest, hex) < 0)
        goto fail;
    if (output) {
        PyObject *values = PyObject_GetAttr(sm, n_values);
        int rc = values ? PyDict_SetItem(e, n_stats, values) : -1;
        Py_XDECREF(values);
        if (rc < 0) goto fail;
    }
    seen = PyObject_GetAttr(s, n_seen_attr);
    if (seen == NULL || !PyDict_Check(seen)) goto fail;
    Py_ssize_t limit = cache_entries();
    if (limit < 0 && PyErr_Occurred()) goto fail;
    if (PyDict_Size(seen) >= limit) PyDict_Clear(seen);
    ref = PyObject_GetAttr(sm, n_ref);
    if (ref == NULL) goto fail;
    if (ref != Py_None) {
        PyObject *obj = PyObject_CallNoArgs(ref);
        if (obj == NULL) goto fail;
        int same = obj == t;
        Py_DECREF(obj);
        if (!same) Py_CLEAR(ref);
    } else {
        Py_CLEAR(ref);
    }
    if (ref == NULL) { /* the summary is another tensor's (an alias at the same key): a reference whose
                          callback drops this record when t dies (_dead_entry) */
        PyObject *dead = PyObject_GetAttr(s, n_dead_cb);
        ref = dead ? PyObject_CallFunctionObjArgs(g_Ref, t, dead, NULL) : NULL;
        Py_XDECREF(dead);
        if (ref == NULL) goto fail;
        PyObject *tid = PyLong_FromVoidPtr(t);
        int rc = tid == NULL ? -1 : PyObject_SetAttr(ref, n_tid, tid);
        Py_XDECREF(tid);
        if (rc < 0 || PyObject_SetAttr(ref, n_key, Py_None) < 0) goto fail;
    }
    rec = PyTuple_Pack(7, ref, version, ptr, sm, dn, size, shape);
    id = PyLong_FromVoidPtr(t);
    if (rec == NULL || id == NULL || PyDict_SetItem(seen, id, rec) < 0) goto fail;
    result = e;
    e = NULL;
fail:
    Py_XDECREF(dn);
    Py_XDECREF(shape);
    Py_XDECREF(e);
    Py_XDECREF(hex);
    Py_XDECREF(seen);
    Py_XDECREF(ref);
    Py_XDECREF(rec);
    Py_XDECREF(id);
    return result;
}

/* _region(): where t's storage starts */
static PyObject *region_of(PyObject *t, PyObject *ptr) {
    PyObject *off = method0(t, n_storage_offset);
    if (off == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
        PyErr_Clear();
        Py_INCREF(ptr);
        return ptr;
    }
    int zero = PyObject_Not(off);
    if (zero) {
        Py_DECREF(off);
        Py_INCREF(ptr);
        return ptr;
    }
    PyObject *size = method0(t, n_element_size);
    PyObject *bytes = size ? PyNumber_Multiply(off, size) : NULL;
    PyObject *r = bytes ? PyNumber_Subtract(ptr, bytes) : NULL;
    Py_DECREF(off);
    Py_XDECREF(size);
    Py_XDECREF(bytes);
    if (r == NULL && PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        Py_INCREF(ptr);
        return ptr;
    }
    return r;
}

/* _remember(): cache sm under key while t is alive (s._shared is empty, s._at is not due a rebuild) */
static int remember(PyObject *s, PyObject *key, PyObject *sm, PyObject *t, PyObject *ptr, PyObject *cache) {
    PyObject *dead = PyObject_GetAttr(s, n_dead_cb);
    if (dead == NULL) return -1;
    PyObject *ref = PyObject_CallFunctionObjArgs(g_Ref, t, dead, NULL);
    Py_DECREF(dead);
    if (ref == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) { /* not weakly referenceable: never reused */
            PyErr_Clear();
            return 0;
        }
        return -1;
    }
    PyObject *region = NULL, *at_all = NULL, *at = NULL;
    int rc = -1;
    {
        PyObject *tid = PyLong_FromVoidPtr(t);
        rc = tid == NULL ? -1 : PyObject_SetAttr(ref, n_tid, tid);
        Py_XDECREF(tid);
        if (rc < 0) goto done;
        rc = -1;
    }
    if (PyObject_SetAttr(ref, n_key, key) < 0 || PyObject_SetAttr(sm, n_ref, ref) < 0) goto done;
    region = region_of(t, ptr);
    if (region == NULL || PyObject_SetAttr(sm, n_region, region) < 0) goto done;
    {
        PyObject *old = PyDict_GetItemWithError(cache, key); /* borrowed */
        if (old == NULL && PyErr_Occurred()) goto done;
        if (old != NULL && old != sm && PyObject_SetAttr(old, n_dead, Py_True) < 0) goto done;
    }
    if (PyDict_SetItem(cache, key, sm) < 0) goto done;
    at_all = PyObject_GetAttr(s, n_at);
    if (at_all == NULL || !PyDict_Check(at_all)) goto done;
    at = PyDict_GetItemWithError(at_all, region); /* borrowed */
    if (at == NULL) {
        if (PyErr_Occurred()) goto done;
        PyObject *fresh = PyList_New(1);
        if (fresh == NULL) goto done;
        Py_INCREF(key);
        PyList_SetItem(fresh, 0, key);
        int r = PyDict_SetItem(at_all, region, fresh);
        Py_DECREF(fresh);
        if (r < 0) goto done;
    } else {
        if (!PyList_Check(at) || PyList_Append(at, key) < 0) goto done;
        Py_ssize_t n = PyList_Size(at);
        if (n > 8 && !(n & (n - 1))) { /* pruned at 16, 32, 64, ... keys */
            PyObject *kept = PyList_New(0);
            if (kept == NULL) goto done;
            for (Py_ssize_t i = 0; i < n; i++) {
                PyObject *k = PyList_GetItem(at, i);
                int in = PyDict_Contains(cache, k);
                if (in < 0 || (in && PyList_Append(kept, k) < 0)) {
                    Py_DECREF(kept);
                    goto done;
                }
            }
            int r = PyList_SetSlice(at, 0, n, kept);
            Py_DECREF(kept);
            if (r < 0) goto done;
        }
    }
    Py_ssize_t limit = cache_entries();
    if (limit < 0 && PyErr_Occurred()) goto done;
    if (PyDict_Size(cache) > limit) { /* _forget(the oldest key) */
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        if (PyDict_Next(cache, &pos, &k, &v)) {
            Py_INCREF(k);
            Py_INCREF(v);
            int r = PyDict_DelItem(cache, k);
            if (r == 0) r = PyObject_SetAttr(v, n_dead, Py_True);
            Py_DECREF(k);
            Py_DECREF(v);
            if (r < 0) goto done;
        }
    }
    rc = 0;
done:
    Py_DECREF(ref);
    Py_XDECREF(region);
    Py_XDECREF(at_all);
    return rc;
}

/* _wrote(): a recorded write landed in the storage at region (content version key): every other
 * cached content of that storage is stale */
static int wrote(PyObject *at_all, PyObject *cache, PyObject *region, PyObject *key) {
    PyObject *at = PyDict_GetItemWithError(at_all, region); /* borrowed */
    if (at == NULL) return PyErr_Occurred() ? -1 : 0;
    if (!PyList_Check(at)) {
        PyErr_SetString(PyExc_TypeError, "Session._at holds a non-list");
        return -1;
    }
    Py_INCREF(at);
    int rc = -1;
    Py_ssize_t n = PyList_Size(at);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyList_GetItem(at, i);
        int ne = PyObject_RichCompareBool(k, key, Py_NE);
        if (ne < 0) goto done;
        if (!ne) continue;
        PyObject *v = PyDict_GetItemWithError(cache, k); /* cache.pop(k, None) */
        if (v == NULL) {
            if (PyErr_Occurred()) goto done;
            continue;
        }
        Py_INCREF(v);
        int r = PyDict_DelItem(cache, k);
        if (r == 0) r = PyObject_SetAttr(v, n_dead, Py_True);
        Py_DECREF(v);
        if (r < 0) goto done;
    }
    {
        int in = PyDict_Contains(cache, key);
        if (in < 0) goto done;
        PyObject *fresh = in ? PyList_New(1) : PyList_New(0);
        if (fresh == NULL) goto done;
        if (in) {
            Py_INCREF(key);
            PyList_SetItem(fresh, 0, key);
        }
        rc = PyDict_SetItem(at_all, region, fresh);
        Py_DECREF(fresh);
    }
done:
    Py_DECREF(at);
    return rc;
}

static PyObject *not_implemented(void) {
    Py_INCREF(Py_NotImplemented);
    return Py_NotImplemented;
}

/* entry(session, call, slot, t, output, fresh) */
static PyObject *entry_c(PyObject *s, PyObject *call, PyObject *slot, PyObject *t, int output, int fresh) {
    (void)call;
    PyObject *native = NULL, *result = NULL, *dtype = NULL, *code = NULL, *version = NULL, *ptr = NULL;
    PyObject *numel = NULL, *key = NULL, *cache = NULL, *sm = NULL, *size = NULL, *o = NULL;
    int r;
    native = PyObject_GetAttr(s, n_host_entry);
    if (native == NULL) return NULL;
    if (native == Py_None) {
        result = not_implemented();
        goto done;
    }
    {   /* what _entry_fast in Python decides: memory shared outside torch, storage groups due a rebuild */
        PyObject *at = PyObject_GetAttr(s, n_at), *shared = at ? PyObject_GetAttr(s, n_shared) : NULL;
        Py_ssize_t nat = at && PyDict_Check(at) ? PyDict_Size(at) : -1;
        Py_ssize_t nsh = shared && PyDict_Check(shared) ? PyDict_Size(shared) : -1;
        Py_XDECREF(at);
        Py_XDECREF(shared);
        if (PyErr_Occurred()) goto done;
        Py_ssize_t limit = PyErr_Occurred() ? -1 : cache_entries();
        if (PyErr_Occurred()) goto done;
        if (nat < 0 || nsh != 0 || nat > 4 * limit) {
            result = not_implemented();
            goto done;
        }
    }
    if (!output && !fresh) { /* the same tensor object, unchanged since its last entry */
        PyObject *seen = PyObject_GetAttr(s, n_seen_attr);
        if (seen == NULL) goto done;
        PyObject *id = PyLong_FromVoidPtr(t);
        PyObject *hit = id && PyDict_Check(seen) ? PyDict_GetItemWithError(seen, id) : NULL; /* borrowed */
        Py_XDECREF(id);
        if (hit != NULL) Py_INCREF(hit);
        Py_DECREF(seen);
        if (hit == NULL && PyErr_Occurred()) goto done;
        if (hit != NULL) {
            int ok = PyTuple_Check(hit) && PyTuple_Size(hit) == 7;
            PyObject *obj = ok ? PyObject_CallNoArgs(PyTuple_GetItem(hit, 0)) : NULL;
            ok = obj != NULL && obj == t;
            Py_XDECREF(obj);
            if (ok) ok = attr_true(PyTuple_GetItem(hit, 3), n_dead) == 0;
            if (ok) ok = attr_eq(t, n_version, PyTuple_GetItem(hit, 1)) == 1;
            if (ok) {
                PyObject *p = method0(t, n_data_ptr);
                ok = p != NULL && PyObject_RichCompareBool(p, PyTuple_GetItem(hit, 2), Py_EQ) == 1;
                Py_XDECREF(p);
            }
            if (ok) ok = attr_eq(t, n_shape, PyTuple_GetItem(hit, 5)) == 1;
            if (PyErr_Occurred()) {
                Py_DECREF(hit);
                goto done;
            }
            if (ok) {
                PyObject *known_sm = PyTuple_GetItem(hit, 3);
                PyObject *hex = PyObject_GetAttr(known_sm, n_hex);
                PyObject *e = hex ? PyDict_New() : NULL;
                if (e != NULL && (PyDict_SetItem(e, n_slot, slot) < 0 ||
                                  PyDict_SetItem(e, n_dtype, PyTuple_GetItem(hit, 4)) < 0 ||
                                  PyDict_SetItem(e, n_shape, PyTuple_GetItem(hit, 6)) < 0 ||
                                  PyDict_SetItem(e, n_device, n_cpu) < 0 || PyDict_SetItem(e, n_digest, hex) < 0))
                    Py_CLEAR(e);
                Py_XDECREF(hex);
                Py_DECREF(hit);
                result = e;
                goto done;
            }
            Py_DECREF(hit);
        }
    }
    {
        PyTypeObject *tt = Py_TYPE(t);
        if ((PyObject *)tt != g_Tensor && (PyObject *)tt != g_Parameter) goto general;
    }
    dtype = PyObject_GetAttr(t, n_dtype);
    if (dtype == NULL) goto done;
    code = module_dict_get(g_hostkernel_mod, n_codes, dtype);
    if (code == NULL) {
        if (PyErr_Occurred()) goto done;
        goto general;
    }
    if ((r = attr_true(t, n_is_cpu)) != 1) goto check;
    o = PyObject_GetAttr(t, n_layout);
    if (o == NULL) goto done;
    r = o == g_strided;
    Py_CLEAR(o);
    if (!r) goto general;
    o = method0(t, n_is_neg);
    if (o == NULL) goto done;
    r = PyObject_IsTrue(o);
    Py_CLEAR(o);
    if (r != 0) goto check;
    o = method0(t, n_is_contiguous);
    if (o == NULL) goto done;
    r = PyObject_IsTrue(o);
    Py_CLEAR(o);
    if (r < 0) goto done;
    if (!r) { /* _entry_strided */
        result = not_implemented();
        goto done;
    }
    numel = method0(t, n_numel);
    if (numel == NULL) goto done;
    if ((r = PyObject_Not(numel)) != 0) goto check;
    version = PyObject_GetAttr(t, n_version);
    if (version == NULL) {
        if (PyErr_ExceptionMatches(PyExc_RuntimeError)) { /* an inference tensor: the general path */
            PyErr_Clear();
            goto general;
        }
        goto done;
    }
    ptr = method0(t, n_data_ptr);
    if (ptr == NULL) goto done;
    key = PyTuple_Pack(5, ptr, numel, dtype, g_cpu, version);
    cache = PyObject_GetAttr(s, n_cache);
    if (key == NULL || cache == NULL) goto done;
    if (!PyDict_Check(cache)) {
        result = not_implemented();
        goto done;
    }
    if (output && fresh) { /* a write (an input object as output): every other cached content of its storage
                            * is stale (_wrote) */
        PyObject *at_all = PyObject_GetAttr(s, n_at);
        if (at_all == NULL) goto done;
        if (!PyDict_Check(at_all)) {
            Py_DECREF(at_all);
            result = not_implemented();
            goto done;
        }
        if (PyDict_Size(at_all)) {
            PyObject *region = region_of(t, ptr);
            int rc = region ? wrote(at_all, cache, region, key) : -1;
            Py_XDECREF(region);
            Py_DECREF(at_all);
            if (rc < 0) goto done;
        } else {
            Py_DECREF(at_all);
        }
    }
    if (!fresh) {
        sm = PyDict_GetItemWithError(cache, key);
        if (sm == NULL && PyErr_Occurred()) goto done;
        Py_XINCREF(sm);
        if (sm != NULL) { /* alive while the tensor it was computed for is */
            PyObject *ref = PyObject_GetAttr(sm, n_ref);
            if (ref == NULL) goto done;
            PyObject *obj = ref == Py_None ? NULL : PyObject_CallNoArgs(ref);
            int live = obj != NULL && obj != Py_None;
            if (live) { /* _holds(): and still at ptr (Tensor.set_, a storage resize: it lives on elsewhere) */
                PyObject *at = method0(obj, n_data_ptr);
                live = at != NULL && PyObject_RichCompareBool(at, ptr, Py_EQ) == 1;
                Py_XDECREF(at);
                if (!live && PyErr_Occurred()) {
                    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
                        Py_DECREF(ref);
                        Py_XDECREF(obj);
                        goto done;
                    }
                    PyErr_Clear(); /* a tensor without memory of its own now: not at ptr */
                }
            }
            Py_DECREF(ref);
            Py_XDECREF(obj);
            if (PyErr_Occurred()) goto done;
            if (!live) Py_CLEAR(sm);
        }
    }
    if (sm == NULL) {
        PyObject *got = PyObject_CallFunctionObjArgs(native, ptr, numel, code, output ? Py_True : Py_False, NULL);
        if (got == NULL) goto done;
        PyObject *hex = PyTuple_Check(got) && PyTuple_Size(got) == 2 ? PyTuple_GetItem(got, 0) : NULL;
        PyObject *row = hex ? PyTuple_GetItem(got, 1) : NULL;
        if (row == NULL || (row != Py_None && !PyDict_CheckExact(row))) { /* not finished: Python's formula */
            Py_DECREF(got);
            result = not_implemented();
            goto done;
        }
        sm = PyObject_CallMethodObjArgs(g_Summary, n_new, g_Summary, NULL);
        if (sm == NULL || PyObject_SetAttr(sm, n_ref, Py_None) < 0 || PyObject_SetAttr(sm, n_digest, Py_None) < 0 ||
            PyObject_SetAttr(sm, n_stats, Py_None) < 0 || PyObject_SetAttr(sm, n_n, numel) < 0 ||
            PyObject_SetAttr(sm, n_hex, hex) < 0 || PyObject_SetAttr(sm, n_values, row) < 0 ||
            PyObject_SetAttr(sm, n_dead, Py_False) < 0 || PyObject_SetAttr(sm, n_region, g_zero) < 0) {
            Py_DECREF(got);
            goto done;
        }
        Py_DECREF(got);
        if (remember(s, key, sm, t, ptr, cache) < 0) goto done;
    } else if (output) { /* has_stats */
        PyObject *st = PyObject_GetAttr(sm, n_stats), *v = st ? PyObject_GetAttr(sm, n_values) : NULL;
        int has = st != NULL && v != NULL && (st != Py_None || v != Py_None);
        Py_XDECREF(st);
        Py_XDECREF(v);
        if (PyErr_Occurred()) goto done;
        if (!has) goto general;
    }
    {
        PyObject *hex = PyObject_GetAttr(sm, n_hex), *values = hex ? PyObject_GetAttr(sm, n_values) : NULL;
        int ready = values != NULL && hex != Py_None && (values != Py_None || !output);
        Py_XDECREF(hex);
        Py_XDECREF(values);
        if (PyErr_Occurred()) goto done;
        if (!ready) { /* a summary still to fill (nothing changed for it here) */
            result = not_implemented();
            goto done;
        }
    }
    size = PyObject_GetAttr(t, n_shape);
    if (size == NULL) goto done;
    result = known(s, slot, t, sm, dtype, size, version, ptr, output);
    goto done;
check:
    if (r < 0) goto done;
general: /* _entry_fast's None: the general path decides */
    Py_INCREF(Py_None);
    result = Py_None;
done:
    Py_XDECREF(native);
    Py_XDECREF(dtype);
    Py_XDECREF(code);
    Py_XDECREF(version);
    Py_XDECREF(ptr);
    Py_XDECREF(numel);
    Py_XDECREF(key);
    Py_XDECREF(cache);
    Py_XDECREF(sm);
    Py_XDECREF(size);
    Py_XDECREF(o);
    return result;
}

/* entry(session, call, slot, t, output, fresh) for Python: see entry_c() */
static PyObject *entry_py(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    if (ready(n, "entry(session, call, slot, t, output, fresh)", 1) < 0) return NULL;
    int output = PyObject_IsTrue(a[4]), fresh = PyObject_IsTrue(a[5]);
    if (output < 0 || fresh < 0) return NULL;
    return entry_c(a[0], a[1], a[2], a[3], output, fresh);
}

/* One tensor entry: session._entry_fast(call, slot, t, output, fresh), else session.entry(...). */
static PyObject *entry(PyObject *s, PyObject *call, PyObject *slot, PyObject *t, int output, int fresh) {
    PyObject *e = NULL;
    PyObject *own = PyObject_GetAttr((PyObject *)Py_TYPE(s), n_entry_fast);
    if (own == NULL) return NULL;
    if (own == g_entry_fast) { /* session.py's own: its common cases in C */
        e = entry_c(s, call, slot, t, output, fresh);
        if (e == Py_NotImplemented) Py_CLEAR(e);
        else if (e == NULL && PyErr_ExceptionMatches(PyExc_Exception)) PyErr_Clear(); /* as below */
        else if (e == NULL) {
            Py_DECREF(own);
            return NULL;
        }
    }
    Py_DECREF(own);
    if (e == NULL && !PyErr_Occurred()) {
        PyObject *fast = PyObject_GetAttr(s, n_entry_fast);
        if (fast != NULL) {
            e = PyObject_CallFunctionObjArgs(fast, call, slot, t, output ? Py_True : Py_False,
                                             fresh ? Py_True : Py_False, NULL);
            Py_DECREF(fast);
        }
    }
    if (e == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) return NULL;
        PyErr_Clear(); /* entry() below says what failed */
    } else if (e != Py_None) {
        return e;
    } else {
        Py_DECREF(e);
    }
    PyObject *general = PyObject_GetAttr(s, n_entry);
    if (general == NULL) return NULL;
    PyObject *pargs = Py_BuildValue("(OOOO)", call, slot, t, output ? Py_True : Py_False);
    PyObject *kw = NULL;
    if (pargs != NULL && fresh) {
        kw = PyDict_New();
        if (kw == NULL || PyDict_SetItem(kw, n_fresh, Py_True) < 0) {
            Py_CLEAR(pargs);
        }
    }
    e = pargs ? PyObject_Call(general, pargs, kw) : NULL;
    Py_DECREF(general);
    Py_XDECREF(pargs);
    Py_XDECREF(kw);
    return e;
}

/* t (a plain Tensor/Parameter) is marked uninitialised (Session._uninit, docs/capture.md §3.7), at its own
 * address or, a view, at its base's: 1; 0 not; -1 error. A tensor whose address cannot be read counts as
 * marked (the Python handler decides). */
static int marked(PyObject *marks, PyObject *t) {
    PyObject *ptr = method0(t, n_data_ptr);
    if (ptr == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
        PyErr_Clear();
        return 1;
    }
    int in = PyDict_Contains(marks, ptr);
    Py_DECREF(ptr);
    if (in != 0) return in;
    PyObject *base = PyObject_GetAttr(t, n_base);
    if (base == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
        PyErr_Clear();
        return 1;
    }
    if (base == Py_None) {
        Py_DECREF(base);
        return 0;
    }
    in = marked(marks, base);
    Py_DECREF(base);
    return in;
}

/* Some tensor argument of the call is (a view of) memory marked uninitialised: the Python handler's
 * entries decide (1); none is (0: the C path's entries are those of the Python handler); -1 error. */
static int marked_args(PyObject *marks, PyObject *args, PyObject *kwargs) {
    Py_ssize_t n = PyTuple_Size(args);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyTuple_GetItem(args, i), *tt = (PyObject *)Py_TYPE(v);
        if (tt == g_Tensor || tt == g_Parameter) {
            int m = marked(marks, v);
            if (m != 0) return m;
        }
    }
    if (kwargs != Py_None && PyDict_Check(kwargs)) {
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        while (PyDict_Next(kwargs, &pos, &k, &v)) {
            PyObject *tt = (PyObject *)Py_TYPE(v);
            if (tt == g_Tensor || tt == g_Parameter) {
                int m = marked(marks, v);
                if (m != 0) return m;
            }
        }
    }
    return 0;
}

/* Session.entry for an output: a mark at t's address is memory a recorded op wrote now (no argument is
 * marked, checked before): dropped. 0, or -1 on an error that is not an Exception. */
static int pop_mark(PyObject *s, PyObject *t) {
    PyObject *marks = PyObject_GetAttr(s, n_uninit);
    if (marks == NULL) return -1;
    int rc = 0;
    if (PyDict_Check(marks) && PyDict_Size(marks)) {
        PyObject *ptr = method0(t, n_data_ptr);
        rc = ptr == NULL ? -1 : PyDict_Contains(marks, ptr);
        if (rc > 0) rc = PyDict_DelItem(marks, ptr);
        Py_XDECREF(ptr);
        if (rc < 0 && PyErr_ExceptionMatches(PyExc_Exception)) { /* no address: nothing marked there */
            PyErr_Clear();
            rc = 0;
        }
    }
    Py_DECREF(marks);
    return rc < 0 ? -1 : 0;
}

/* entries(session, call, pairs, output, fresh): Session.inputs()/outputs() for a record of many tensors (an
 * optimizer step's): [entry(session, call, slot, t, output, fresh) for slot, t in pairs], one call from Python
 * instead of a Session.entry() frame per tensor. A plain Tensor/Parameter goes through entry() above (C, and
 * its fallbacks: _entry_fast, then Session.entry); any other object through session.entry(call, slot, t,
 * output, fresh=fresh), which reads a subclass as a Tensor. The caller (Session.inputs/outputs) takes this
 * path only where Session.entry() would go straight to its fast path: the host kernel digesting, no
 * uninitialised memory marked, no entry of its own marked uninitialised. */
static PyObject *entries_py(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    if (n != 5) {
        PyErr_Format(PyExc_TypeError, "opguard.capture._fastcall.entries takes 5 arguments, got %zd", n);
        return NULL;
    }
    if ((configured & 1) != 1) {
        PyErr_SetString(PyExc_RuntimeError, "opguard.capture._fastcall.entries: called before configure_entry()");
        return NULL;
    }
    PyObject *s = a[0], *call = a[1];
    int output = PyObject_IsTrue(a[3]), fresh = PyObject_IsTrue(a[4]);
    if (output < 0 || fresh < 0) return NULL;
    if (!PyList_Check(a[2])) {
        PyErr_SetString(PyExc_TypeError, "entries: pairs must be a list of (slot, tensor)");
        return NULL;
    }
    PyObject *seq = a[2];
    Py_ssize_t m = PyList_Size(seq);
    {   /* memory marked uninitialised (§3.7): NotImplemented, nothing done, if a tensor is (a view of) it */
        PyObject *marks = PyObject_GetAttr(s, n_uninit);
        if (marks == NULL) return NULL;
        int r = PyDict_Check(marks) ? 0 : 1;
        for (Py_ssize_t i = 0; r == 0 && PyDict_Size(marks) && i < m; i++) {
            PyObject *pair = PyList_GetItem(seq, i);
            PyObject *t = pair && PyTuple_Check(pair) && PyTuple_Size(pair) == 2 ? PyTuple_GetItem(pair, 1) : NULL;
            if (t == NULL) {
                r = 1;
                break;
            }
            PyObject *tt = (PyObject *)Py_TYPE(t);
            if (tt == g_Tensor || tt == g_Parameter) r = marked(marks, t);
        }
        Py_DECREF(marks);
        if (r < 0) return NULL;
        if (r) return not_implemented();
    }
    Py_INCREF(seq);
    PyObject *out = PyList_New(m);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        PyObject *pair = PyList_GetItem(seq, i); /* borrowed; NULL: the list shrank meanwhile */
        if (pair == NULL) goto fail;
        if (!PyTuple_Check(pair) || PyTuple_Size(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "entries: pairs must be (slot, tensor) tuples");
            goto fail;
        }
        Py_INCREF(pair); /* the list may change while Python code runs below */
        PyObject *slot = PyTuple_GetItem(pair, 0), *t = PyTuple_GetItem(pair, 1), *e;
        PyObject *tt = (PyObject *)Py_TYPE(t);
        if (tt == g_Tensor || tt == g_Parameter) {
            if (output && pop_mark(s, t) < 0) {
                Py_DECREF(pair);
                goto fail;
            }
            e = entry(s, call, slot, t, output, fresh);
        } else {
            PyObject *general = PyObject_GetAttr(s, n_entry);
            PyObject *pargs = general ? PyTuple_Pack(4, call, slot, t, output ? Py_True : Py_False) : NULL;
            PyObject *kw = pargs ? PyDict_New() : NULL;
            e = kw != NULL && PyDict_SetItem(kw, n_fresh, fresh ? Py_True : Py_False) == 0
                    ? PyObject_Call(general, pargs, kw) : NULL;
            Py_XDECREF(general);
            Py_XDECREF(pargs);
            Py_XDECREF(kw);
        }
        Py_DECREF(pair);
        if (e == NULL) goto fail;
        if (PyList_SetItem(out, i, e) < 0) goto fail; /* steals e */
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}

static PyObject *list_attr(PyObject *o, PyObject *name) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (v != NULL && !PyList_Check(v)) {
        Py_DECREF(v);
        return NULL;
    }
    return v;
}

/* The common call, recorded: what CaptureMode.handle() does after its checks for a planned function. */
static PyObject *record(PyObject *s, PyObject *caller, PyObject *func, PyObject *args, PyObject *kwargs,
                        PyObject *plan, PyObject *via) {
    PyObject *name = PyTuple_GetItem(plan, 0);  /* borrowed */
    int method = PyObject_IsTrue(PyTuple_GetItem(plan, 1));
    int seeded = PyObject_IsTrue(PyTuple_GetItem(plan, 2));
    PyObject *written = PyTuple_GetItem(plan, 3); /* frozenset of slots, or None */
    PyObject *call = NULL, *rec = NULL, *ins = NULL, *xs = NULL, *result = NULL, *parents = NULL, *seq = NULL;
    PyObject *outs = NULL;
    Py_ssize_t nargs = PyTuple_Size(args);

    ins = PyList_New(0);
    xs = PyList_New(0);
    if (ins == NULL || xs == NULL) goto error;

    /* ---- the record and its inputs (CaptureMode.handle: "try: ... except Exception: failed") ---- */
    {
        PyObject *modules = NULL, *contexts = NULL, *module = NULL, *context = NULL, *sites = NULL, *site = NULL;
        PyObject *begin = NULL, *bargs = NULL, *kw = NULL, *where = NULL;
        int ok = 0;
        modules = list_attr(s, n_modules);
        contexts = list_attr(s, n_contexts);
        if (modules == NULL || contexts == NULL) goto rec_done;
        if (PyList_Size(modules)) {
            module = PyList_GetItem(modules, PyList_Size(modules) - 1);
            Py_INCREF(module);
        } else {
            module = Py_None;
            Py_INCREF(module);
        }
        if (PyList_Size(contexts)) {
            context = PyUnicode_Join(n_slash, contexts);
            if (context == NULL) goto rec_done;
        } else {
            context = Py_None;
            Py_INCREF(context);
        }
        sites = PyObject_GetAttr(s, n_sites);
        if (sites == NULL) goto rec_done;
        site = PyObject_CallMethodObjArgs(sites, n_call_site, caller, NULL);
        if (site == NULL) goto rec_done;
        if (site == Py_None) { /* made by torch's tensor rebuilding (docs/capture.md §3.5): not recorded */
            ok = 1;
            goto rec_done;
        }
        begin = PyObject_GetAttr(s, n_begin);
        if (begin == NULL) goto rec_done;
        bargs = PyTuple_Pack(3, n_function, name, site);
        where = PyTuple_Pack(2, module, context);
        kw = PyDict_New();
        if (bargs == NULL || where == NULL || kw == NULL || PyDict_SetItem(kw, n_where, where) < 0) goto rec_done;
        call = PyObject_Call(begin, bargs, kw);
        if (call == NULL) goto rec_done;
        rec = PyObject_GetAttr(call, n_rec);
        if (rec == NULL || !PyDict_Check(rec)) goto rec_done;
        if (seeded && PyDict_SetItem(rec, n_seeded, Py_True) < 0) goto rec_done;
        for (Py_ssize_t i = 0; i < nargs; i++) {
            PyObject *slot = (i == 0 && method) ? n_self : arg_slots[i];
            if (split(slot, PyTuple_GetItem(args, i), ins, xs) < 0) goto rec_done;
        }
        if (kwargs != NULL) {
            PyObject *k, *v;
            Py_ssize_t pos = 0;
            while (PyDict_Next(kwargs, &pos, &k, &v)) {
                if (split(k, v, ins, xs) < 0) goto rec_done;
            }
        }
        if (PyList_Size(xs) && PyDict_SetItem(rec, n_args, xs) < 0) goto rec_done;
        {
            PyObject *inputs = PyDict_GetItem(rec, n_inputs); /* borrowed */
            if (inputs == NULL) {
                PyErr_SetString(PyExc_KeyError, "inputs");
                goto rec_done;
            }
            Py_ssize_t n = PyList_Size(ins);
            for (Py_ssize_t i = 0; i < n; i++) {
                PyObject *pair = PyList_GetItem(ins, i);
                PyObject *e = entry(s, call, PyTuple_GetItem(pair, 0), PyTuple_GetItem(pair, 1), 0, 0);
                if (e == NULL) goto rec_done;
                int rc = PyList_Append(inputs, e);
                Py_DECREF(e);
                if (rc < 0) goto rec_done;
            }
        }
        ok = 1;
    rec_done:
        Py_XDECREF(modules);
        Py_XDECREF(contexts);
        Py_XDECREF(module);
        Py_XDECREF(context);
        Py_XDECREF(sites);
        Py_XDECREF(site);
        Py_XDECREF(begin);
        Py_XDECREF(bargs);
        Py_XDECREF(kw);
        Py_XDECREF(where);
        if (!ok) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "session state of an unexpected type");
            if (contain(s, call) < 0) goto error;
        }
    }

    if (call == NULL) { /* capture's own failure before the record existed: run it, see its writes */
        result = PyObject_CallFunctionObjArgs(via, func, args, kwargs, NULL);
        if (result == NULL) goto error;
        PyObject *r = call_global(g_mode_mod, n_unselected, s, name, func, args, kwargs, result);
        Py_DECREF(result);
        result = r;
        goto done;
    }

    /* ---- the call ---- */
    parents = list_attr(s, n_parents);
    if (parents == NULL || rec == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "session.parents is not a list");
        goto error;
    }
    seq = PyDict_GetItem(rec, n_seq);
    if (seq == NULL) {
        PyErr_SetString(PyExc_KeyError, "seq");
        goto error;
    }
    Py_INCREF(seq);
    if (PyList_Append(parents, seq) < 0) goto error;
    result = PyObject_CallFunctionObjArgs(via, func, args, kwargs, NULL);
    {
        PyObject *type = NULL, *value = NULL, *tb = NULL;
        if (result == NULL) {
            PyErr_Fetch(&type, &value, &tb);
            PyErr_NormalizeException(&type, &value, &tb);
            PyObject *tname = type ? PyObject_GetAttr(type, n_name) : NULL;
            PyObject *msg = tname && value ? PyUnicode_FromFormat("%U: %S", tname, value) : NULL;
            PyObject *cut = msg ? PyUnicode_Substring(msg, 0, 500) : NULL;
            if (cut == NULL || PyDict_SetItem(rec, n_error, cut) < 0) PyErr_Clear();
            Py_XDECREF(tname);
            Py_XDECREF(msg);
            Py_XDECREF(cut);
        }
        Py_ssize_t n = PyList_Size(parents); /* parents.pop() */
        if (n > 0 && PySequence_DelItem(parents, n - 1) < 0) PyErr_Clear();
        if (result == NULL) {
            PyErr_Restore(type, value, tb);
            goto error;
        }
    }

    /* ---- the outputs (CaptureMode.handle: "try: ... except Exception: failed") ---- */
    {
        int ok = 0;
        int cap = attr_true(s, n_cap_reached);
        if (cap < 0) goto out_done;
        if (!cap) {
            PyObject *outputs, *tail = NULL;
            if ((PyObject *)Py_TYPE(result) == g_Tensor) {
                outs = PyList_New(0);
                PyObject *pair = PyTuple_Pack(2, n_out, result);
                if (outs == NULL || pair == NULL || PyList_Append(outs, pair) < 0) {
                    Py_XDECREF(pair);
                    goto out_done;
                }
                Py_DECREF(pair);
            } else {
                PyObject *it = call_global(g_mode_mod, n_tensors_in, result, n_out, NULL, NULL, NULL, NULL);
                if (it == NULL) goto out_done;
                outs = PySequence_List(it);
                Py_DECREF(it);
                if (outs == NULL) goto out_done;
            }
            Py_ssize_t nin = PyList_Size(ins);
            if (written != Py_None && nin) { /* _written_outputs: written inputs the result does not hold */
                for (Py_ssize_t i = 0; i < nin; i++) {
                    PyObject *pair = PyList_GetItem(ins, i);
                    int w = PySequence_Contains(written, PyTuple_GetItem(pair, 0));
                    if (w < 0) goto out_done;
                    if (!w) continue;
                    PyObject *t = PyTuple_GetItem(pair, 1);
                    int held = 0;
                    for (Py_ssize_t j = 0; j < PyList_Size(outs); j++) {
                        if (PyTuple_GetItem(PyList_GetItem(outs, j), 1) == t) {
                            held = 1;
                            break;
                        }
                    }
                    if (!held && PyList_Append(outs, pair) < 0) goto out_done;
                }
            }
            outputs = PyDict_GetItem(rec, n_outputs); /* borrowed */
            if (outputs == NULL) {
                PyErr_SetString(PyExc_KeyError, "outputs");
                goto out_done;
            }
            Py_ssize_t nout = PyList_Size(outs);
            for (Py_ssize_t j = 0; j < nout; j++) {
                /* Session.entry: an output at a marked address is memory a recorded op wrote (the marked
                 * tensor is gone: no argument was it, handle() checked): its content is a result now */
                PyObject *t = PyTuple_GetItem(PyList_GetItem(outs, j), 1), *tt = (PyObject *)Py_TYPE(t);
                if ((tt == g_Tensor || tt == g_Parameter) && pop_mark(s, t) < 0) goto out_done;
            }
            for (Py_ssize_t j = 0; j < nout; j++) {
                PyObject *pair = PyList_GetItem(outs, j);
                PyObject *t = PyTuple_GetItem(pair, 1);
                int wrote = 0;
                for (Py_ssize_t i = 0; i < nin; i++) {
                    if (PyTuple_GetItem(PyList_GetItem(ins, i), 1) == t) {
                        wrote = 1;
                        break;
                    }
                }
                PyObject *e = entry(s, call, PyTuple_GetItem(pair, 0), t, 1, wrote);
                if (e == NULL) goto out_done;
                int rc = PyList_Append(outputs, e);
                Py_DECREF(e);
                if (rc < 0) goto out_done;
            }
            /* inside a watched wrapper call: what this call took and gave (Call.ids) */
            PyObject *wrappers = PyObject_GetAttr(s, n_wrappers);
            int watching = wrappers ? attr_true(wrappers, n_watching) : -1;
            Py_XDECREF(wrappers);
            if (watching < 0) goto out_done;
            if (watching) {
                PyObject *a = PySet_New(NULL), *b = PySet_New(NULL);
                int bad = a == NULL || b == NULL;
                for (Py_ssize_t i = 0; !bad && i < nin; i++) {
                    PyObject *id = PyLong_FromVoidPtr(PyTuple_GetItem(PyList_GetItem(ins, i), 1));
                    bad = id == NULL || PySet_Add(a, id) < 0;
                    Py_XDECREF(id);
                }
                for (Py_ssize_t j = 0; !bad && j < nout; j++) {
                    PyObject *id = PyLong_FromVoidPtr(PyTuple_GetItem(PyList_GetItem(outs, j), 1));
                    bad = id == NULL || PySet_Add(b, id) < 0;
                    Py_XDECREF(id);
                }
                PyObject *fa = bad ? NULL : PyFrozenSet_New(a), *fb = bad ? NULL : PyFrozenSet_New(b);
                tail = fa && fb ? PyTuple_Pack(2, fa, fb) : NULL;
                Py_XDECREF(a);
                Py_XDECREF(b);
                Py_XDECREF(fa);
                Py_XDECREF(fb);
                if (tail == NULL || PyObject_SetAttr(call, n_ids, tail) < 0) {
                    Py_XDECREF(tail);
                    goto out_done;
                }
                Py_DECREF(tail);
            }
        }
        ok = 1;
    out_done:
        if (!ok) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "session state of an unexpected type");
            if (contain(s, call) < 0) goto error;
        }
    }

    /* ---- no record open: the finished records sealed, written once the buffer is full ---- */
    if (PyList_Size(parents) == 0) {
        PyObject *r = PyObject_CallMethodObjArgs(s, n_maybe_flush, NULL);
        if (r == NULL) goto error;
        Py_DECREF(r);
    }

done:
    Py_XDECREF(call);
    Py_XDECREF(rec);
    Py_XDECREF(ins);
    Py_XDECREF(xs);
    Py_XDECREF(parents);
    Py_XDECREF(seq);
    Py_XDECREF(outs);
    return result;
error:
    Py_CLEAR(result);
    goto done;
}

/* handle(mode, caller, func, types, args, kwargs) */
static PyObject *handle(PyObject *self, PyObject *const *a, Py_ssize_t n) {
    (void)self;
    if (ready(n, "handle(mode, caller, func, types, args, kwargs)", 3) < 0) return NULL;
    PyObject *mode = a[0], *caller = a[1], *func = a[2], *types = a[3], *args = a[4], *kwargs = a[5];
    PyObject *s = NULL, *plans = NULL, *plan = NULL, *inflight = NULL, *via = NULL, *result = NULL;
    PyObject *kwd = NULL;
    int r;

    if (!PyTuple_Check(args) || (kwargs != Py_None && !PyDict_Check(kwargs)) || caller == Py_None)
        return slow(mode, caller, func, types, args, kwargs);
    /* an out= argument is not read: the Python handler records it without its content (mode.py) */
    if (kwargs != Py_None && PyDict_GetItemString(kwargs, "out") != NULL)
        return slow(mode, caller, func, types, args, kwargs);
    s = PyObject_GetAttr(mode, n_session);
    if (s == NULL) return NULL;
    /* the checks of CaptureMode.handle that send a call elsewhere, and this path's own conditions */
    if ((r = attr_true(s, n_busy)) != 0) goto to_slow;
    {   /* a function always passed through (metadata, unrecorded noise): via(func, args, kwargs) */
        PyObject *passes = PyObject_GetAttr(mode, n_passes);
        if (passes == NULL) goto error;
        int p = PyAnySet_Check(passes) ? PySet_Contains(passes, func) : 0;
        Py_DECREF(passes);
        if (p < 0) {
            PyErr_Clear(); /* unhashable */
            p = 0;
        }
        if (p) {
            via = call_global(g_mode_mod, n_standin, caller, NULL, NULL, NULL, NULL, NULL);
            if (via == NULL) goto error;
            if (kwargs == Py_None) {
                kwd = PyDict_New();
                if (kwd == NULL) goto error;
            } else {
                kwd = kwargs;
                Py_INCREF(kwd);
            }
            result = PyObject_CallFunctionObjArgs(via, func, args, kwd, NULL);
            goto done;
        }
    }
    if ((r = attr_is_none(s, n_quiet)) != 1) goto to_slow;
    inflight = PyObject_GetAttr(s, n_inflight);
    if (inflight == NULL) goto error;
    if (PyObject_Length(inflight) != 0) goto to_slow;
    plans = PyObject_GetAttr(mode, n_plans);
    if (plans == NULL) goto error;
    if (!PyDict_Check(plans)) goto to_slow;
    plan = PyDict_GetItemWithError(plans, func); /* borrowed */
    if (plan == NULL) {
        PyErr_Clear(); /* not planned, or unhashable */
        goto to_slow;
    }
    if (!PyTuple_Check(plan) || PyTuple_Size(plan) != 4) goto to_slow;
    Py_INCREF(plan);
    if ((r = attr_true(s, n_cap_reached)) != 0) goto to_slow;
    if ((r = attr_true(s, n_closed)) != 0) goto to_slow;
    if ((r = attr_true(s, n_all_steps)) != 1) goto to_slow;
    if ((r = attr_true(s, n_select_all)) != 1) goto to_slow;
    if ((r = attr_true(s, n_host_digest)) != 1) goto to_slow;
    {   /* memory marked uninitialised: the Python handler, unless no tensor argument is (a view of) it */
        PyObject *marks = PyObject_GetAttr(s, n_uninit);
        if (marks == NULL) goto error;
        r = !PyDict_Check(marks) ? 1 : PyDict_Size(marks) ? marked_args(marks, args, kwargs) : 0;
        Py_DECREF(marks);
        if (r != 0) goto to_slow;
    }
    {
        PyObject *policy = PyObject_GetAttr(s, n_policy);
        if (policy == NULL) goto error;
        r = attr_true(policy, n_enabled);
        Py_DECREF(policy);
        if (r != 0) goto to_slow;
        PyObject *wrappers = PyObject_GetAttr(s, n_wrappers);
        if (wrappers == NULL) goto error;
        r = attr_true(wrappers, n_watching);
        Py_DECREF(wrappers);
        if (r != 0) goto to_slow;
    }
    /* every argument one the common steps file (decided before anything is recorded) */
    {
        Py_ssize_t na = PyTuple_Size(args);
        if (na > SLOTS) goto to_slow;
        PyObject *kind;
        for (Py_ssize_t i = 0; i < na; i++) {
            if (!classify(PyTuple_GetItem(args, i), &kind)) goto to_slow;
        }
        if (kwargs != Py_None) {
            PyObject *k, *v;
            Py_ssize_t pos = 0;
            while (PyDict_Next(kwargs, &pos, &k, &v)) {
                if (!PyUnicode_Check(k) || !classify(v, &kind)) goto to_slow;
            }
        }
    }
    via = call_global(g_mode_mod, n_standin, caller, NULL, NULL, NULL, NULL, NULL);
    if (via == NULL) goto error;
    if (kwargs == Py_None) {
        kwd = PyDict_New();
        if (kwd == NULL) goto error;
    } else {
        kwd = kwargs;
        Py_INCREF(kwd);
    }
    result = record(s, caller, func, args, kwd, plan, via);
    goto done;

to_slow:
    if (r < 0) goto error;
    result = slow(mode, caller, func, types, args, kwargs);
    goto done;
error:
    result = NULL;
done:
    Py_XDECREF(s);
    Py_XDECREF(plans);
    Py_XDECREF(plan);
    Py_XDECREF(inflight);
    Py_XDECREF(via);
    Py_XDECREF(kwd);
    return result;
}

/* configure_entry(records_module, Tensor, Parameter, session_module, hostkernel_module, entry_fast, Summary,
 *                 Ref, cpu, strided): what entry() reads (session.py calls it) */
static PyObject *configure_entry(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *v[10];
    if (!PyArg_UnpackTuple(args, "configure_entry", 10, 10, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7],
                           &v[8], &v[9]))
        return NULL;
    PyObject **dst[10] = {&g_records_mod, &g_Tensor, &g_Parameter, &g_session_mod, &g_hostkernel_mod, &g_entry_fast,
                          &g_Summary, &g_Ref, &g_cpu, &g_strided};
    for (int i = 0; i < 10; i++) {
        PyObject *old = *dst[i];
        Py_INCREF(v[i]);
        *dst[i] = v[i];
        Py_XDECREF(old);
    }
    configured |= 1;
    Py_RETURN_NONE;
}

/* configure(mode_module, simple_types): what handle() reads besides (mode.py calls it) */
static PyObject *configure(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *mod, *simple;
    if (!PyArg_UnpackTuple(args, "configure", 2, 2, &mod, &simple)) return NULL;
    if (!PyTuple_Check(simple)) {
        PyErr_SetString(PyExc_TypeError, "simple_types must be a tuple of types");
        return NULL;
    }
    PyObject *old_mod = g_mode_mod, *old_simple = g_simple;
    Py_INCREF(mod);
    Py_INCREF(simple);
    g_mode_mod = mod;
    g_simple = simple;
    Py_XDECREF(old_mod);
    Py_XDECREF(old_simple);
    configured |= 2;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"handle", (PyCFunction)(void (*)(void))handle, METH_FASTCALL,
     "handle(mode, caller, func, types, args, kwargs): CaptureMode.handle() for the common call"},
    {"entry", (PyCFunction)(void (*)(void))entry_py, METH_FASTCALL,
     "entry(session, call, slot, t, output, fresh): Session._entry_fast for its common cases; NotImplemented: "
     "_entry_fast decides"},
    {"entries", (PyCFunction)(void (*)(void))entries_py, METH_FASTCALL,
     "entries(session, call, pairs, output, fresh): [entry(...) for slot, t in pairs] (Session.inputs/outputs)"},
    {"configure_entry", configure_entry, METH_VARARGS,
     "configure_entry(records_module, Tensor, Parameter, session_module, hostkernel_module, entry_fast, Summary, "
     "Ref, cpu, strided)"},
    {"configure", configure, METH_VARARGS, "configure(mode_module, simple_types)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastcall", "The function mode's common call in C (docs/capture.md §3.11).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastcall(void) {
    struct {
        PyObject **p;
        const char *s;
    } names[] = {
        {&n_session, "session"}, {&n_busy, "busy"}, {&n_quiet, "quiet"}, {&n_inflight, "inflight"},
        {&n_plans, "plans"}, {&n_cap_reached, "cap_reached"}, {&n_closed, "closed"}, {&n_all_steps, "all_steps"},
        {&n_select_all, "select_all"}, {&n_policy, "policy"}, {&n_enabled, "enabled"},
        {&n_host_digest, "host_digest"}, {&n_uninit, "_uninit"}, {&n_wrappers, "wrappers"},
        {&n_watching, "watching"}, {&n_modules, "modules"}, {&n_contexts, "contexts"}, {&n_sites, "sites"},
        {&n_call_site, "call_site"}, {&n_begin, "begin"}, {&n_rec, "rec"}, {&n_seq, "seq"}, {&n_parents, "parents"},
        {&n_entry_fast, "_entry_fast"}, {&n_entry, "entry"}, {&n_fresh, "fresh"}, {&n_failed, "failed"},
        {&n_recording, "recording"}, 
        {&n_maybe_flush, "maybe_flush_contained"}, {&n_function, "function"}, {&n_where, "where"},
        {&n_inputs, "inputs"}, {&n_outputs, "outputs"}, {&n_args, "args"}, {&n_seeded, "seeded"},
        {&n_error, "error"}, {&n_out, "out"}, {&n_self, "self"}, {&n_slot, "slot"}, {&n_type, "type"},
        {&n_value, "value"}, {&n_float, "float"}, {&n_int, "int"}, {&n_bool, "bool"}, {&n_none, "none"},
        {&n_ids, "ids"}, {&n_slash, "/"}, {&n_handle, "handle"}, {&n_name, "__name__"},
        {&n_passes, "passes"},
        {&n_standin, "standin"}, {&n_unselected, "_unselected"}, {&n_tensors_in, "tensors_in"},
        {&n_arg_entry, "arg_entry"}, {&n_dtype_name, "dtype_name"}, {&n_hex, "hex"}, {&n_dtype, "dtype"},
        {&n_shape, "shape"}, {&n_device, "device"}, {&n_cpu, "cpu"}, {&n_digest, "digest"}, {&n_stats, "stats"},
        {&n_values, "values"}, {&n_seen_attr, "_seen"}, {&n_ref, "ref"}, {&n_storage_offset, "storage_offset"},
        {&n_element_size, "element_size"}, {&n_dead_cb, "_dead"}, {&n_key, "key"}, {&n_tid, "tid"}, {&n_region, "region"},
        {&n_dead, "dead"}, {&n_at, "_at"}, {&n_shared, "_shared"}, {&n_host_entry, "host_entry"}, {&n_base, "_base"},
        {&n_version, "_version"}, {&n_data_ptr, "data_ptr"}, {&n_is_cpu, "is_cpu"}, {&n_layout, "layout"},
        {&n_is_neg, "is_neg"}, {&n_is_contiguous, "is_contiguous"}, {&n_numel, "numel"}, {&n_cache, "_cache"},
        {&n_new, "__new__"}, {&n_n, "n"}, {&n_cache_entries, "CACHE_ENTRIES"}, {&n_dtype_names, "_DTYPE_NAMES"},
        {&n_codes, "CODES"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if (intern(names[i].p, names[i].s) < 0) return NULL;
    }
    g_zero = PyLong_FromLong(0);
    if (g_zero == NULL) return NULL;
    for (int i = 0; i < SLOTS; i++) {
        char b[16];
        snprintf(b, sizeof b, "arg%d", i);
        if (intern(&arg_slots[i], b) < 0) return NULL;
    }
    return PyModule_Create(&module);
}
