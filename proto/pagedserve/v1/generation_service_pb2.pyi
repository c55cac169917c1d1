from pagedserve.v1 import embed_pb2 as _embed_pb2
from pagedserve.v1 import generate_pb2 as _generate_pb2
from pagedserve.v1 import model_info_pb2 as _model_info_pb2
from pagedserve.v1 import tokenize_pb2 as _tokenize_pb2
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor
