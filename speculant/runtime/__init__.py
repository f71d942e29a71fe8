"""The CPU runtime under the decoding loop: weight formats, kernel routes chosen by measurement, compiled steps."""
