/* Region-of-interest JPEG decoding for the fused train/eval transforms (fastload.loader.images._jpeg).
 *
 * decode_region(data, scale_denom, top, left, height, width) decodes only the rows and columns a
 * crop needs, at DCT scale 1/scale_denom, with libjpeg-turbo's jpeg_crop_scanline (columns,
 * rounded out to whole iMCUs) and jpeg_skip_scanlines (rows above the region; rows below it are
 * never decoded). The region is given in the coordinates of the scaled image and must lie inside
 * it. The result is a bytearray of height * width * 3 RGB bytes, row-major: the same pixels as a
 * whole-image decode (accurate integer IDCT, fancy upsampling: simplejpeg's defaults) cut to the
 * region. The GIL is released while decoding.
 *
 * Errors: ValueError for data libjpeg cannot decode into RGB or warns about (damage, CMYK,
 * arithmetic coding where unsupported) or a region outside the image; the caller then decodes
 * the whole image, which reports damage as before. Damage in rows below the region is not seen
 * (they are not decoded); the caller checks that the data ends with the EOI marker, which
 * catches truncation.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} ErrorManager;

static void on_error(j_common_ptr cinfo) {
    ErrorManager *err = (ErrorManager *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

/* Warnings (libjpeg decodes damaged data with them, e.g. a truncated file as grey rows) fail
 * the decode: the caller then decodes the whole image, which reports the damage. */
static void on_warning(j_common_ptr cinfo, int level) {
    if (level < 0) {
        ErrorManager *err = (ErrorManager *)cinfo->err;
        (*cinfo->err->format_message)(cinfo, err->message);
        longjmp(err->jump, 1);
    }
}

typedef struct {
    const unsigned char *data;
    size_t size;
    int denom, top, left, height, width;
    unsigned char *out;
    JSAMPLE *row;
    char message[JMSG_LENGTH_MAX];
    int bad_region;
} Job;

/* Runs without the GIL. Returns 0 on success, -1 with job->message set. */
static int run(Job *job) {
    struct jpeg_decompress_struct cinfo;
    ErrorManager err;
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_warning;
    job->row = NULL;
    if (setjmp(err.jump)) {
        memcpy(job->message, err.message, sizeof(job->message));
        free(job->row);
        job->row = NULL;
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, (unsigned char *)job->data, (unsigned long)job->size);
    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
        snprintf(job->message, sizeof(job->message), "CMYK/YCCK JPEG");
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)job->denom;
    cinfo.dct_method = JDCT_ISLOW;
    cinfo.do_fancy_upsampling = TRUE;
    jpeg_start_decompress(&cinfo);
    if (job->top < 0 || job->left < 0 || job->height <= 0 || job->width <= 0 ||
        (JDIMENSION)(job->top + job->height) > cinfo.output_height ||
        (JDIMENSION)(job->left + job->width) > cinfo.output_width ||
        cinfo.output_components != 3) {
        job->bad_region = 1;
        snprintf(job->message, sizeof(job->message),
                 "region %d+%d x %d+%d outside the %ux%u scaled image (or not 3 channels)",
                 job->top, job->height, job->left, job->width, cinfo.output_height,
                 cinfo.output_width);
        jpeg_abort_decompress(&cinfo);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    JDIMENSION xoffset = (JDIMENSION)job->left, crop_width = (JDIMENSION)job->width;
    if (crop_width < cinfo.output_width) {
        jpeg_crop_scanline(&cinfo, &xoffset, &crop_width);
    } else {
        xoffset = 0;
        crop_width = cinfo.output_width;
    }
    /* After cropping, output_width is the cropped width; the wanted columns start at
     * left - xoffset within each scanline. */
    size_t row_bytes = (size_t)cinfo.output_width * 3;
    job->row = (JSAMPLE *)malloc(row_bytes);
    if (job->row == NULL) {
        snprintf(job->message, sizeof(job->message), "out of memory");
        jpeg_abort_decompress(&cinfo);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    if (job->top > 0) {
        JDIMENSION skipped = jpeg_skip_scanlines(&cinfo, (JDIMENSION)job->top);
        if (skipped != (JDIMENSION)job->top) {
            snprintf(job->message, sizeof(job->message), "could not skip to row %d", job->top);
            free(job->row);
            job->row = NULL;
            jpeg_abort_decompress(&cinfo);
            jpeg_destroy_decompress(&cinfo);
            return -1;
        }
    }
    size_t first = (size_t)(job->left - (int)xoffset) * 3, out_row = (size_t)job->width * 3;
    for (int y = 0; y < job->height; y++) {
        JSAMPROW rows[1] = {job->row};
        if (jpeg_read_scanlines(&cinfo, rows, 1) != 1) {
            snprintf(job->message, sizeof(job->message), "premature end of data at row %d",
                     job->top + y);
            free(job->row);
            job->row = NULL;
            jpeg_abort_decompress(&cinfo);
            jpeg_destroy_decompress(&cinfo);
            return -1;
        }
        memcpy(job->out + (size_t)y * out_row, job->row + first, out_row);
    }
    free(job->row);
    job->row = NULL;
    jpeg_abort_decompress(&cinfo); /* the rows below the region are not needed */
    jpeg_destroy_decompress(&cinfo);
    return 0;
}

static PyObject *decode_region(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer buf;
    Job job;
    memset(&job, 0, sizeof(job));
    if (!PyArg_ParseTuple(args, "y*iiiii", &buf, &job.denom, &job.top, &job.left, &job.height,
                          &job.width)) {
        return NULL;
    }
    if (job.denom != 1 && job.denom != 2 && job.denom != 4 && job.denom != 8) {
        PyBuffer_Release(&buf);
        PyErr_Format(PyExc_ValueError, "scale_denom must be 1, 2, 4 or 8, got %d", job.denom);
        return NULL;
    }
    if (job.height <= 0 || job.width <= 0 || job.height > 65535 || job.width > 65535) {
        PyBuffer_Release(&buf);
        PyErr_Format(PyExc_ValueError, "bad region size %d x %d", job.height, job.width);
        return NULL;
    }
    PyObject *out = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)job.height * job.width * 3);
    if (out == NULL) {
        PyBuffer_Release(&buf);
        return NULL;
    }
    job.data = (const unsigned char *)buf.buf;
    job.size = (size_t)buf.len;
    job.out = (unsigned char *)PyByteArray_AS_STRING(out);
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = run(&job);
    Py_END_ALLOW_THREADS PyBuffer_Release(&buf);
    if (rc != 0) {
        Py_DECREF(out);
        PyErr_Format(PyExc_ValueError, "JPEG region decode failed: %s", job.message);
        return NULL;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"decode_region", decode_region, METH_VARARGS,
     "decode_region(data, scale_denom, top, left, height, width) -> bytearray of RGB rows"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpegroi", NULL, -1, methods};

PyMODINIT_FUNC PyInit__jpegroi(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "JPEG_LIB_VERSION", JPEG_LIB_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
