# Types of the compiled online cost fit (_fit.pyx).
from typing import Literal, Optional, Union

import numpy as np
import numpy.typing as npt

def fit_window(steps: npt.NDArray[np.float64], prior: npt.NDArray[np.float64], clip: float,
               floor: float, prior_weight: float, rounds: int,
               ) -> Optional[Union[Literal["kept"], tuple[float, ...]]]: ...
