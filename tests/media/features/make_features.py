"""Writes the .npy test files of tests/data/data_test.cpp (NumPy 1.24, Debian 12): run here."""
import numpy as np

a = np.arange(12, dtype=np.float32).reshape(3, 4)  # a[t, d] = 4 t + d
np.save("f4_3x4.npy", a)
np.save("f8_fortran_2x3.npy", np.asfortranarray(np.arange(6, dtype=np.float64).reshape(2, 3)))
np.save("f2_3x4.npy", (a / 2).astype(np.float16))
np.save("i8_4.npy", np.array([-2, -1, 0, 7], dtype=np.int64))
with open("f4_version2_3x4.npy", "wb") as f:
    np.lib.format.write_array(f, a, version=(2, 0))
np.save("f4_bigendian_3x4.npy", a.astype(">f4"))
np.save("structured.npy", np.zeros(3, dtype=[("x", "<f4"), ("y", "<i4")]))
data = open("f4_3x4.npy", "rb").read()
open("f4_truncated_3x4.npy", "wb").write(data[: len(data) - 8])  # the last two numbers cut
