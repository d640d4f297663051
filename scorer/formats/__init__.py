"""Published DFlash checkpoint layouts other than the plain HF directory, one module each."""
