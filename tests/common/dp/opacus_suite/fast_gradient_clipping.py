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
"""The models and data of Opacus's fast-gradient-clipping tests.

Vendored from Opacus 1.6.0 (the PyPI wheel ``opacus-1.6.0``), Apache-2.0:
``opacus/tests/grad_sample_module_fast_gradient_clipping_test.py``, its ``SyntheticDataset``,
``SampleModule`` and ``SampleEmbeddingModule``, verbatim. The tests that use them compare one
step of ghost clipping with Opacus's per-sample-gradient step; ``test_opacus_suite.py`` runs
them with an engine's ``make_private(..., grad_sample_mode="ghost")`` as the ghost side.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset


class SyntheticDataset(Dataset):
    def __init__(self, size, length, dim):
        self.size = size
        self.length = length
        self.dim = dim
        self.images = torch.randn(self.size, self.length, self.dim)
        self.labels = torch.randint(0, 2, size=(self.size, self.length), dtype=torch.float32)

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        image = self.images[index]
        label = self.labels[index]
        return image, label


class SampleModule(nn.Module):
    def __init__(self):
        super(SampleModule, self).__init__()
        self.fc1 = nn.Linear(2, 2)
        self.fc3 = nn.Linear(2, 1024)
        self.fc4 = nn.Linear(1024, 10)
        self.fc5 = nn.Linear(10, 1)
        self.layer_norm = nn.LayerNorm(2)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = self.layer_norm(x)
        x = self.fc3(x)
        x = self.fc4(x)
        x = self.fc5(x).flatten(start_dim=1)
        x = F.softmax(x)
        return x


class SampleEmbeddingModule(nn.Module):
    def __init__(self, vocab_size, embedding_dim):
        super(SampleEmbeddingModule, self).__init__()
        self.embedding = nn.Embedding(vocab_size, embedding_dim)

        # Manually set weights for the embedding layer for testing
        self.embedding.weight = nn.Parameter(torch.tensor([[0.1], [0.2], [0.3]]))

    def forward(self, x):
        x = self.embedding(x)
        return x
