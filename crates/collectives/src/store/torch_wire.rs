//! PyTorch's TCPStore wire protocol.
