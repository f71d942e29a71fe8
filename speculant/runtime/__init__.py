"""The CPU runtime under the decoding loop: weight formats, kernel routes chosen by measurement, compiled steps.

Importing it installs the C row kernels (:mod:`speculant.kernels.sampling`) under the sampling package's
temperature softmax and draws (:func:`speculant.sampling.processors.install_row_kernels`): they run where the
kernels build, torch's operations elsewhere.
"""

from ..kernels import sampling as _row_kernels
from ..sampling.processors import install_row_kernels

install_row_kernels(_row_kernels)
