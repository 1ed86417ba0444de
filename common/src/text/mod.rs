//! Text that the frontend and the router read alike: the tokenizer file, the chat template (with the
//! Python it emulates), the piecewise encoder, and the default model's folder for tests.
pub mod chat_template;
pub mod default_model;
pub mod piecewise_encoder;
pub mod python_compat;
pub mod tokenizer_file;
