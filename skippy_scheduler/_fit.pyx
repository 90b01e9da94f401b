# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""The online cost fit's arithmetic in C (engine/cost_fit.py, `StepCostFitter.fit`).

One refit is a handful of least-squares solves of six terms over at most a few hundred steps,
with the window's relative residuals and their medians between them. In numpy that is a
thousand calls or so, 0.4-1 ms of the engine thread holding the GIL; here it is a few µs
without it. The arithmetic is the numpy path's (`cost_model.fit_coefficients` with a prior,
`_hold_negatives_at_zero`, `_active_set`, and the clip rounds of `StepCostFitter.fit`), which
stays as the reference this is tested against (tests/engine/test_cost_fit.py); the one case
left to it is the search over every subset of the terms that `fit_coefficients` falls back to
when the active set does not settle, for which `fit_window` returns None.
"""
from libc.math cimport fabs, isfinite
from libc.stdlib cimport malloc, free, qsort

cdef enum:
    NT = 6  # the terms of `cost_model.step_terms`


cdef int _cmp(const void *a, const void *b) noexcept nogil:
    cdef double x = (<const double *> a)[0]
    cdef double y = (<const double *> b)[0]
    return (x > y) - (x < y)


cdef double _median(const double *v, const char *keep, int n, double *scratch) noexcept nogil:
    """numpy's median of v[keep] (the mean of the two middle values of an even count)."""
    cdef int m = 0, i
    for i in range(n):
        if keep[i]:
            scratch[m] = v[i]
            m += 1
    qsort(scratch, m, sizeof(double), _cmp)
    if m % 2:
        return scratch[m // 2]
    return (scratch[m // 2 - 1] + scratch[m // 2]) / 2.0


cdef int _solve_free(const double *gram, const double *h, const char *free_,
                     double *out) noexcept nogil:
    """out = the solution of gram · b = h over the free terms, 0 for the others (Gaussian
    elimination with partial pivoting); -1 when a pivot is 0."""
    cdef double a[NT][NT + 1]
    cdef int idx[NT]
    cdef int m = 0, i, j, k, p
    cdef double t, f
    for i in range(NT):
        out[i] = 0.0
        if free_[i]:
            idx[m] = i
            m += 1
    for i in range(m):
        for j in range(m):
            a[i][j] = gram[idx[i] * NT + idx[j]]
        a[i][m] = h[idx[i]]
    for k in range(m):
        p = k
        for i in range(k + 1, m):
            if fabs(a[i][k]) > fabs(a[p][k]):
                p = i
        if a[p][k] == 0.0:
            return -1
        if p != k:
            for j in range(m + 1):
                t = a[k][j]
                a[k][j] = a[p][j]
                a[p][j] = t
        for i in range(k + 1, m):
            f = a[i][k] / a[k][k]
            for j in range(k, m + 1):
                a[i][j] -= f * a[k][j]
    for i in range(m - 1, -1, -1):
        t = a[i][m]
        for j in range(i + 1, m):
            t -= a[i][j] * out[idx[j]]
        out[idx[i]] = t / a[i][i]
    return 0


cdef int _hold_negatives_at_zero(const double *gram, const double *h,
                                 double *coef) noexcept nogil:
    cdef char free_[NT]
    cdef int i, any_free, negative
    for i in range(NT):
        free_[i] = 1
        coef[i] = 0.0
    while True:
        any_free = 0
        for i in range(NT):
            any_free |= free_[i]
        if not any_free:
            return 0
        if _solve_free(gram, h, free_, coef):
            return -1
        negative = 0
        for i in range(NT):
            if coef[i] < 0:
                negative = 1
                free_[i] = 0
                coef[i] = 0.0
        if not negative:
            return 0


cdef int _active_set(const double *gram, const double *h, double tol,
                     double *coef) noexcept nogil:
    """`cost_model._active_set`: 0 with coef set, 1 when its passes run out, -1 on a zero
    pivot."""
    cdef char free_[NT]
    cdef char blocked[NT]
    cdef double trial[NT]
    cdef int i, j, outer, inner, best, nblocked, any_free
    cdef double d, best_d, gap, ratio, best_ratio
    for i in range(NT):
        free_[i] = 0
        coef[i] = 0.0
    for outer in range(4 * NT):
        best = -1
        best_d = 0.0
        for i in range(NT):
            d = 0.0
            for j in range(NT):
                d += gram[i * NT + j] * coef[j]
            d = h[i] - d  # minus half the gradient
            if free_[i]:
                continue
            if best < 0 or d > best_d:  # numpy's argmax: the first of equal values
                best = i
                best_d = d
        if best < 0 or not best_d > tol:
            return 0
        free_[best] = 1
        for inner in range(NT):
            if _solve_free(gram, h, free_, trial):
                return -1
            nblocked = 0
            for i in range(NT):
                blocked[i] = free_[i] and trial[i] <= 0
                nblocked += blocked[i]
            if not nblocked:
                for i in range(NT):
                    coef[i] = trial[i]
                break
            best = -1
            best_ratio = 0.0
            for i in range(NT):
                if not blocked[i]:
                    continue
                gap = coef[i] - trial[i]
                ratio = coef[i] / gap if gap > 0 else 0.0
                if best < 0 or ratio < best_ratio:
                    best = i
                    best_ratio = ratio
            for i in range(NT):
                coef[i] = coef[i] + best_ratio * (trial[i] - coef[i])
            free_[best] = 0
            any_free = 0
            for i in range(NT):
                if not coef[i] > 0:
                    free_[i] = 0
                if not free_[i]:
                    coef[i] = 0.0
                any_free |= free_[i]
            if not any_free:
                break
    return 1


cdef int _fit_coefficients(const double *x, const double *y, const char *keep, int n,
                           const double *prior, double prior_weight,
                           double *coef) noexcept nogil:
    """`cost_model.fit_coefficients(x[keep], y[keep], prior, prior_weight)`: 0 with coef
    set, 1 where it would search every subset (left to numpy), -1 on a zero pivot."""
    cdef double gram[NT * NT]
    cdef double h[NT]
    cdef double xw[NT]
    cdef int r, i, j, rc
    cdef double inv, yw, norm_max, floor, scale, gram_max, coef_max, h_max, tol, g
    for i in range(NT):
        h[i] = 0.0
        for j in range(NT):
            gram[i * NT + j] = 0.0
    for r in range(n):
        if not keep[r]:
            continue
        inv = 1.0 / (y[r] if y[r] > 1.0 else 1.0)
        yw = y[r] if y[r] < 1.0 else 1.0
        for i in range(NT):
            xw[i] = x[r * NT + i] * inv
        for i in range(NT):
            h[i] += xw[i] * yw
            for j in range(NT):
                gram[i * NT + j] += xw[i] * xw[j]
    # The columns' sums of squares are the diagonal, before the pull is added to it.
    norm_max = gram[0]
    for i in range(1, NT):
        if gram[i * NT + i] > norm_max:
            norm_max = gram[i * NT + i]
    floor = norm_max * 1e-9 + 1e-300
    for i in range(NT):
        scale = (gram[i * NT + i] if gram[i * NT + i] > floor else floor) * prior_weight
        gram[i * NT + i] += scale
        h[i] += scale * prior[i]
    if _hold_negatives_at_zero(gram, h, coef):
        return -1
    gram_max = 0.0
    coef_max = 0.0
    h_max = 0.0
    for i in range(NT):
        if fabs(coef[i]) > coef_max:
            coef_max = fabs(coef[i])
        if fabs(h[i]) > h_max:
            h_max = fabs(h[i])
        for j in range(NT):
            if fabs(gram[i * NT + j]) > gram_max:
                gram_max = fabs(gram[i * NT + j])
    tol = 1e-9 * (gram_max * coef_max + h_max)
    rc = 0
    for i in range(NT):
        if coef[i] != 0.0:
            continue
        g = 0.0
        for j in range(NT):
            g += gram[i * NT + j] * coef[j]
        if not g - h[i] >= -tol:  # the gradient (half the objective's) where held at 0
            rc = 1
    if rc == 0:
        return 0
    rc = _active_set(gram, h, tol, coef)
    if rc:
        return rc
    for i in range(NT):
        if not isfinite(coef[i]):
            return 1
    return 0


def fit_window(const double[:, ::1] steps, const double[::1] prior, double clip, double floor,
               double prior_weight, int rounds):
    """`StepCostFitter.fit`'s arithmetic over a window: `steps` one row a step (prefill tokens,
    decode rows, prefill rows, prefill positions summed, µs > 0), whose terms are
    `cost_model.step_terms`'s; `prior` the current model's six terms. Returns the six fitted
    coefficients (not yet clipped at 0), the string "kept" when the prior already explains
    the window (median relative residual within `floor`), or None where the numpy path must
    decide (a solve that searches every subset, or a zero pivot)."""
    cdef int n = steps.shape[0]
    if steps.shape[1] != 5 or prior.shape[0] != NT:
        raise ValueError(f"fit_window takes steps of n rows x 5 and a prior of {NT} terms")
    if n == 0:
        raise ValueError("fit_window needs at least one step")
    cdef double *x = <double *> malloc(n * NT * sizeof(double))
    cdef double *y = <double *> malloc(n * sizeof(double))
    cdef double *residual = <double *> malloc(n * sizeof(double))
    cdef double *scratch = <double *> malloc(n * sizeof(double))
    cdef char *keep = <char *> malloc(n)
    cdef char *trimmed = <char *> malloc(n)
    cdef double beta[NT]
    cdef int r, i, rc = 0, kept, same, rnd, verdict = 0
    cdef double p, spread, bound
    if (residual == NULL or scratch == NULL or keep == NULL or trimmed == NULL or x == NULL
            or y == NULL):
        free(residual); free(scratch); free(keep); free(trimmed); free(x); free(y)
        raise MemoryError()
    try:
        with nogil:
            for r in range(n):  # `cost_model.step_terms`
                x[r * NT + 0] = 1.0
                x[r * NT + 1] = steps[r, 0]
                x[r * NT + 2] = 1.0 if steps[r, 1] > 0 else 0.0
                x[r * NT + 3] = steps[r, 1]
                x[r * NT + 4] = steps[r, 2] - 1.0 if steps[r, 2] - 1.0 > 0 else 0.0
                x[r * NT + 5] = steps[r, 3] / 1000.0
                y[r] = steps[r, 4]
            for r in range(n):
                keep[r] = 1
                p = 0.0
                for i in range(NT):
                    p += x[r * NT + i] * prior[i]
                residual[r] = fabs(p - y[r]) * (1.0 / y[r])
            if _median(residual, keep, n, scratch) <= floor:
                verdict = 1
            else:
                rc = _fit_coefficients(x, y, keep, n, &prior[0], prior_weight, beta)
                rnd = 0
                while rc == 0 and rnd < rounds:
                    rnd += 1
                    for r in range(n):
                        p = 0.0
                        for i in range(NT):
                            p += x[r * NT + i] * beta[i]
                        residual[r] = fabs(p - y[r]) * (1.0 / y[r])
                    spread = _median(residual, keep, n, scratch)
                    bound = clip * spread if clip * spread > floor else floor
                    kept = 0
                    same = 1
                    for r in range(n):
                        trimmed[r] = residual[r] <= bound
                        kept += trimmed[r]
                        same &= trimmed[r] == keep[r]
                    if kept < 4 or same:
                        break
                    for r in range(n):
                        keep[r] = trimmed[r]
                    rc = _fit_coefficients(x, y, keep, n, &prior[0], prior_weight, beta)
        if verdict:
            return "kept"
        if rc:
            return None
        return tuple(beta[i] for i in range(NT))
    finally:
        free(residual)
        free(scratch)
        free(keep)
        free(trimmed)
        free(x)
        free(y)
