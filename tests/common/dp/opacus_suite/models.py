# Copyright (c) Meta Platforms, Inc. and affiliates.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ruff: noqa
"""Opacus's sample models, datasets and test cases for ``BasePrivacyEngineTest``.

Vendored from Opacus 1.6.0 (the PyPI wheel ``opacus-1.6.0``), Apache-2.0:
``opacus/tests/privacy_engine_test.py`` (from ``SampleConvNet`` to the end) and, from
``opacus/tests/utils.py``, ``CustomLinearModule`` and ``LinearWithExtraParam``. Kept verbatim
but for one change: torchvision is not a dependency, so ``FakeData`` (random images through
``ToTensor`` and ``Normalize``) is ``fake_images`` below, random images normalized alike.
"""

import itertools
import unittest

import torch
import torch.nn as nn
import torch.nn.functional as F
from opacus.layers.dp_multihead_attention import DPMultiheadAttention
from torch.utils.data import DataLoader, Dataset, TensorDataset

from .privacy_engine import BasePrivacyEngineTest


def fake_images(size: int, image_size: tuple, num_classes: int) -> TensorDataset:
    """torchvision's ``FakeData`` after ``ToTensor()`` and ``Normalize((0.1307,), (0.3081,))``
    (uniform pixels in [0, 1], random labels); not an Opacus source."""
    x = (torch.rand(size, *image_size) - 0.1307) / 0.3081
    return TensorDataset(x, torch.randint(0, num_classes, (size,)))


class CustomLinearModule(nn.Module):
    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self._weight = nn.Parameter(torch.randn(out_features, in_features))
        self._bias = nn.Parameter(torch.randn(out_features))

    def forward(self, x):
        return F.linear(x, self._weight, self._bias)


class LinearWithExtraParam(nn.Module):
    def __init__(self, in_features: int, out_features: int, hidden_dim: int = 8):
        super().__init__()
        self.fc = nn.Linear(in_features, hidden_dim)
        self.extra_param = nn.Parameter(torch.randn(hidden_dim, out_features))

    def forward(self, x):
        x = self.fc(x)
        x = x.matmul(self.extra_param)
        return x


class SampleConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 8, 3)
        self.gnorm1 = nn.GroupNorm(4, 16)
        self.conv2 = nn.Conv1d(16, 32, 3, 1)
        self.lnorm1 = nn.LayerNorm((32, 23))
        self.conv3 = nn.Conv1d(32, 32, 3, 1, bias=False)
        # self.instnorm1 = nn.InstanceNorm1d(32, affine=True)
        self.convf = nn.Conv1d(32, 32, 1, 1)
        for p in self.convf.parameters():
            p.requires_grad = False
        self.fc1 = nn.Linear(21, 17)
        self.lnorm2 = nn.LayerNorm(17)
        self.fc2 = nn.Linear(32 * 17, 10)

        # for layer in (self.gnorm1, self.lnorm1, self.lnorm2, self.instnorm1):
        #     nn.init.uniform_(layer.weight)
        #     nn.init.uniform_(layer.bias)
        for param in self.parameters():
            nn.init.uniform_(param)

    def forward(self, x):
        # x of shape [B, 1, 28, 28]
        x = self.conv1(x)  # -> [B, 16, 10, 10]
        x = self.gnorm1(x)  # -> [B, 16, 10, 10]
        x = F.relu(x)  # -> [B, 16, 10, 10]
        x = F.max_pool2d(x, 2, 2)  # -> [B, 16, 5, 5]
        x = x.view(x.shape[0], x.shape[1], x.shape[2] * x.shape[3])  # -> [B, 16, 25]
        x = self.conv2(x)  # -> [B, 32, 23]
        x = self.lnorm1(x)  # -> [B, 32, 23]
        x = F.relu(x)  # -> [B, 32, 23]
        x = self.conv3(x)  # -> [B, 32, 21]
        # x = self.instnorm1(x)  # -> [B, 32, 21]
        x = self.convf(x)  # -> [B, 32, 21]
        x = self.fc1(x)  # -> [B, 32, 17]
        x = self.lnorm2(x)  # -> [B, 32, 17]
        x = x.view(-1, x.shape[-2] * x.shape[-1])  # -> [B, 32 * 17]
        x = self.fc2(x)  # -> [B, 10]
        return x

    def name(self):
        return "SampleConvNet"


class PrivacyEngineConvNetTest(BasePrivacyEngineTest, unittest.TestCase):
    def _init_data(self):
        ds = fake_images(size=self.DATA_SIZE, image_size=(1, 35, 35), num_classes=10)
        return DataLoader(ds, batch_size=self.BATCH_SIZE, drop_last=False)

    def _init_model(self):
        return SampleConvNet()


@unittest.skip("Incompatible with the new empty batch handling")
class PrivacyEngineConvNetEmptyBatchTest(PrivacyEngineConvNetTest):
    def setUp(self) -> None:
        super().setUp()

        # This will trigger multiple empty batches with poisson sampling enabled
        self.BATCH_SIZE = 1

    def test_checkpoints(self) -> None:
        pass

    def test_noise_level(self) -> None:
        pass


class PrivacyEngineConvNetFrozenTest(BasePrivacyEngineTest, unittest.TestCase):
    def _init_data(self):
        ds = fake_images(size=self.DATA_SIZE, image_size=(1, 35, 35), num_classes=10)
        return DataLoader(ds, batch_size=self.BATCH_SIZE, drop_last=False)

    def _init_model(self):
        m = SampleConvNet()
        for p in itertools.chain(m.conv1.parameters(), m.gnorm1.parameters()):
            p.requires_grad = False

        return m


class PrivacyEngineConvNetFrozenTestFunctorch(PrivacyEngineConvNetFrozenTest):
    def setUp(self) -> None:
        super().setUp()
        self.GRAD_SAMPLE_MODE = "functorch"


class PrivacyEngineConvNetTestExpandedWeights(PrivacyEngineConvNetTest):
    def setUp(self) -> None:
        super().setUp()
        self.GRAD_SAMPLE_MODE = "ew"

    @unittest.skip("Original p.grad is not available in ExpandedWeights")
    def test_sample_grad_aggregation(self) -> None:
        pass


class PrivacyEngineConvNetTestFunctorch(PrivacyEngineConvNetTest):
    def setUp(self) -> None:
        super().setUp()
        self.GRAD_SAMPLE_MODE = "functorch"


class SampleAttnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 8)
        self.attn = DPMultiheadAttention(8, 1)
        self.fc = nn.Linear(8, 1)

        for param in self.parameters():
            nn.init.uniform_(param)

    def forward(self, x):
        x = self.emb(x)
        x, _ = self.attn(x, x, x)
        x = self.fc(x)
        x = x.permute(1, 0, 2)
        x = x.reshape(x.shape[0], -1)
        return x


class MockTextDataset(Dataset):
    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_first: bool = False):
        if batch_first:
            x_batch = x.shape[0]
        else:
            x_batch = x.shape[1]

        if x_batch != y.shape[0]:
            raise ValueError(
                f"Tensor shapes don't match. x:{x.shape}, y:{y.shape}, batch_first:{batch_first}"
            )

        self.x = x
        self.y = y
        self.batch_first = batch_first

    def __getitem__(self, index):
        if self.batch_first:
            return (self.x[index], self.y[index])
        else:
            return (
                self.x[
                    :,
                    index,
                ],
                self.y[index],
            )

    def __len__(self):
        return self.y.shape[0]


def batch_second_collate(batch):
    data = torch.stack([x[0] for x in batch]).permute(1, 0)
    labels = torch.stack([x[1] for x in batch])
    return data, labels


class PrivacyEngineTextTest(BasePrivacyEngineTest, unittest.TestCase):
    def setUp(self):
        super().setUp()
        self.BATCH_FIRST = False

    def _init_data(self):
        x = torch.randint(0, 100, (12, self.DATA_SIZE))
        y = torch.randint(0, 12, (self.DATA_SIZE,))
        ds = MockTextDataset(x, y)
        return DataLoader(
            ds,
            batch_size=self.BATCH_SIZE,
            collate_fn=batch_second_collate,
            drop_last=False,
        )

    def _init_model(self, private=False, state_dict=None, model=None, **privacy_engine_kwargs):
        return SampleAttnNet()


class PrivacyEngineTextTestFunctorch(PrivacyEngineTextTest):
    def setUp(self) -> None:
        super().setUp()
        self.GRAD_SAMPLE_MODE = "functorch"


class SampleTiedWeights(nn.Module):
    def __init__(self, tie=True):
        super().__init__()
        self.emb = nn.Embedding(100, 8)
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 100)

        w = torch.empty(100, 8)
        nn.init.uniform_(w, -100, 100)

        if tie:
            p = nn.Parameter(w)
            self.emb.weight = p
            self.fc2.weight = p
        else:
            self.emb.weight = nn.Parameter(w.clone())
            self.fc2.weight = nn.Parameter(w.clone())

    def forward(self, x):
        x = x.unsqueeze(1)
        x = self.emb(x)
        x = self.fc1(x)
        x = self.fc2(x)
        x = x.squeeze(1)

        return x


class PrivacyEngineTiedWeightsTest(BasePrivacyEngineTest, unittest.TestCase):
    def setUp(self):
        super().setUp()

    def _init_data(self):
        ds = TensorDataset(
            torch.randint(low=0, high=100, size=(self.DATA_SIZE,)),
            torch.randint(low=0, high=100, size=(self.DATA_SIZE,)),
        )
        return DataLoader(ds, batch_size=self.BATCH_SIZE, drop_last=False)

    def _init_model(self):
        return SampleTiedWeights(tie=True)


class PrivacyEngineTiedWeightsTestFunctorch(PrivacyEngineTiedWeightsTest):
    def setUp(self) -> None:
        super().setUp()
        self.GRAD_SAMPLE_MODE = "functorch"


class ModelWithCustomLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = CustomLinearModule(4, 8)
        self.fc2 = LinearWithExtraParam(8, 4)
        self.extra_param = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        x = self.fc1(x)
        x = self.fc2(x)
        x = x.matmul(self.extra_param)
        return x


class PrivacyEngineCustomLayerTest(BasePrivacyEngineTest, unittest.TestCase):
    def _init_data(self):
        ds = TensorDataset(
            torch.randn(self.DATA_SIZE, 4),
            torch.randint(low=0, high=3, size=(self.DATA_SIZE,)),
        )
        return DataLoader(ds, batch_size=self.BATCH_SIZE, drop_last=False)

    def _init_model(self):
        return ModelWithCustomLinear()


# ============================================================================
# Hooks-based tests - Same tests but with wrap_model=False
# ============================================================================


class PrivacyEngineConvNetHooksTest(PrivacyEngineConvNetTest):
    """Test ConvNet with hooks-based approach (no model wrapping)."""

    def setUp(self) -> None:
        super().setUp()
        self.WRAP_MODEL = False


class PrivacyEngineConvNetFrozenHooksTest(PrivacyEngineConvNetFrozenTest):
    """Test ConvNet with frozen layers using hooks-based approach."""

    def setUp(self) -> None:
        super().setUp()
        self.WRAP_MODEL = False


class PrivacyEngineTextHooksTest(PrivacyEngineTextTest):
    """Test text models with hooks-based approach."""

    def setUp(self) -> None:
        super().setUp()
        self.WRAP_MODEL = False


class PrivacyEngineTiedWeightsHooksTest(PrivacyEngineTiedWeightsTest):
    """Test tied weights with hooks-based approach."""

    def setUp(self) -> None:
        super().setUp()
        self.WRAP_MODEL = False


class PrivacyEngineCustomLayerHooksTest(PrivacyEngineCustomLayerTest):
    """Test custom layers with hooks-based approach."""

    def setUp(self) -> None:
        super().setUp()
        self.WRAP_MODEL = False
